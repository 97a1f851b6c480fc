"""The routing dashboard and the router's alert rules of the chart, evaluated by a real
Prometheus on real data from a local fleet: two real vLLM servers (CPU build, the plugin, KV
events) behind the real vllm-router with the kv_aware policy (``arc_dev.fleet``, ports
27200-27291).

Prometheus scrapes the engines through the scrape job the Prometheus Operator builds from the
chart's engine PodMonitor and the router's ``--prometheus-port`` through the one it builds from
the chart's router PodMonitor (container ``router``, port ``metrics``), every second, and
evaluates the chart's alert rules with every duration divided by 60, as
tests/prometheus/test_live_dashboards.py does for the engines.

The scenario, run once in this order:

1. routed: prompts sharing three prefixes, sent through the router; no routing alert may be
   pending or firing, and every routing-dashboard query must return sane data over this window;
2. skew: sent straight to the engines, replica 0 gets prompts it has cached, replica 1 prompts
   nobody has; the per-replica hit-rate alert fires for replica 1;
3. fallback: clients ask the router for /tokenize, whose prompt it cannot route by prefix;
   the load-balancing fallback alert fires;
4. worker down: replica 1 stops; the router's health checks fail and its worker alert fires;
5. router down: the router stops; the router-down alert fires.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import yaml

from arc_dev import dashboards
from arc_dev.dashboards import Intervals, PanelQuery, expand
from arc_dev.fleet import SERVED_MODEL, Fleet
from arc_dev.prometheus import EngineTarget, PrometheusServer, pod_monitor_job
from arc_dev.tinymodel import build_tiny_llama
from tests.chart.chart_helpers import ALERTS_FILE
from tests.prometheus.live_stack import (
    AlertRecorder,
    router_monitor_job,
    shared_prefix_prompts,
    shortened_rules,
    unique_prompts,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRAPE_S = 1.0
RULE_TIME_FACTOR = 60
PORT_BASE = 27200  # the fleet's servers on 27200 and 27210, its router on 27290 and 27291
NAMESPACE, SERVINGPOLICY = "llm", "chat"
ENGINE_MONITOR, ROUTER_MONITOR = "rel-arc-serving-engine", "rel-arc-serving-router"
PODS, ROUTER_POD = ("chat-0", "chat-1"), "chat-router-0"
CAPACITY_BLOCKS = 64
PREFIX_TOKENS, SUFFIX_TOKENS = 4 * 32, 8  # four full 32-token blocks shared, then a suffix
FAMILIES, ROUTED_REQUESTS = 3, 48
ALERT_TIMEOUT_S = 120.0
# The router checks its workers every second and gives one up after 3 failures (its default).
ROUTER_ARGS = ("--health-check-interval-secs", "1")

CHART_RULES = yaml.safe_load(ALERTS_FILE.read_text(encoding="utf-8"))["groups"]
ROUTING_GROUP, ROUTING_DASHBOARD = "arc-serving.routing", "routing.json"
ROUTING_RULES = {
    rule["alert"]: rule
    for group in CHART_RULES
    if group["name"] == ROUTING_GROUP
    for rule in group["rules"]
}
PHASES = {
    "skew": {"ArcServingReplicaHitRateLow": PODS[1]},
    "fallback": {"ArcServingRoutingFallback": None},
    "worker_down": {"ArcServingRouterWorkerUnhealthy": ROUTER_POD},
    "router_down": {"ArcServingRouterDown": ROUTER_POD},
}
ROUTING_QUERIES = dashboards.panel_queries(dashboards.load(ROUTING_DASHBOARD))
ALL = {"namespace": None, "servingpolicy": None, "pod": None}


@dataclass(slots=True)
class Scenario:
    """When each phase ran and every alert state seen meanwhile."""

    routed: tuple[float, float]
    skew: tuple[float, float]
    fallback: tuple[float, float]
    worker_down: tuple[float, float]
    router_down: tuple[float, float]
    recorder: AlertRecorder


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = build_tiny_llama(tmp_path_factory.mktemp("routing-model"))
    work = tmp_path_factory.mktemp("routing-fleet")
    with Fleet(model, work_dir=work, replicas=2, policy="kv_aware", port_base=PORT_BASE,
               capacity_blocks=CAPACITY_BLOCKS, router_args=ROUTER_ARGS) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def prometheus(fleet: Fleet) -> Iterator[PrometheusServer]:
    engines = [
        EngineTarget(server.url.removeprefix("http://"), NAMESPACE, pod, SERVINGPOLICY)
        for server, pod in zip(fleet.servers, PODS, strict=True)
    ]
    router = EngineTarget(
        f"127.0.0.1:{fleet.router.metrics_port}", NAMESPACE, ROUTER_POD, SERVINGPOLICY
    )
    jobs = [
        pod_monitor_job(NAMESPACE, ENGINE_MONITOR, engines, SCRAPE_S),
        router_monitor_job(NAMESPACE, ROUTER_MONITOR, [router], SCRAPE_S),
    ]
    rules = {"alerts.yaml": shortened_rules(CHART_RULES, RULE_TIME_FACTOR)}
    with PrometheusServer(jobs, rule_files=rules, evaluation_interval_s=SCRAPE_S) as prom:
        prom.wait_until(lambda: len(prom.query("up == 1")) == 3, 30, "the first scrapes")
        yield prom


def post(fleet: Fleet, url: str, path: str, body: dict[str, Any]) -> None:
    """One request with the fleet's key; raises on an error answer."""
    answer = requests.post(url + path, json=body, headers=fleet.auth_headers, timeout=120)
    answer.raise_for_status()


def complete(fleet: Fleet, url: str, prompt: list[int]) -> None:
    post(fleet, url, "/v1/completions", {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2})


def until_firing(
    recorder: AlertRecorder, name: str, start: float, action: Callable[[], None]
) -> tuple[float, float]:
    """Repeat ``action`` until alert ``name`` fires; the phase's (start, end)."""
    while "firing" not in recorder.states(name, start, time.time()):
        assert time.time() - start < ALERT_TIMEOUT_S, f"{name} did not fire"
        action()
    return start, time.time()


@pytest.fixture(scope="module")
def scenario(fleet: Fleet, prometheus: PrometheusServer) -> Iterator[Scenario]:
    recorder = AlertRecorder(prometheus)
    recorder.start()
    try:
        # 1. routed traffic: one client per prefix family at once, so that the router weighs
        #    cached prefixes against load and both replicas get requests
        start = time.time()

        def client(seed: int) -> None:
            prompts = shared_prefix_prompts(PREFIX_TOKENS, SUFFIX_TOKENS, seed)
            for _ in range(ROUTED_REQUESTS // FAMILIES):
                complete(fleet, fleet.router.url, next(prompts))

        with ThreadPoolExecutor(FAMILIES) as pool:
            list(pool.map(client, range(FAMILIES)))
        # Two more scrapes, so that the last requests reach the rate windows.
        time.sleep(2 * SCRAPE_S)
        routed = (start, time.time())

        # 2. skew: replica 0 serves a prefix it has cached, replica 1 prompts nobody has
        cached = shared_prefix_prompts(PREFIX_TOKENS, SUFFIX_TOKENS, seed=0)
        fresh = unique_prompts(PREFIX_TOKENS + SUFFIX_TOKENS, seed=FAMILIES)

        def skewed() -> None:
            complete(fleet, fleet.servers[0].url, next(cached))
            complete(fleet, fleet.servers[1].url, next(fresh))

        skew = until_firing(recorder, "ArcServingReplicaHitRateLow", time.time(), skewed)

        # 3. fallback: requests whose prompt the router cannot route by its prefix
        def tokenize() -> None:
            post(fleet, fleet.router.url, "/tokenize", {"model": SERVED_MODEL, "prompt": "a b"})
            time.sleep(0.2)

        fallback = until_firing(recorder, "ArcServingRoutingFallback", time.time(), tokenize)

        # 4. a worker goes away; the router keeps running
        start = time.time()
        fleet.servers[1].stop()
        recorder.wait_for({"ArcServingRouterWorkerUnhealthy": "firing"}, start, ALERT_TIMEOUT_S)
        worker_down = (start, time.time())

        # 5. the router goes away
        start = time.time()
        fleet.router.stop()
        recorder.wait_for({"ArcServingRouterDown": "firing"}, start, ALERT_TIMEOUT_S)
        router_down = (start, time.time())
    finally:
        recorder.stop()
    yield Scenario(routed, skew, fallback, worker_down, router_down, recorder)


# ----------------------------------------------------------------------------- alerts
def test_routed_traffic_raises_no_routing_alert(scenario: Scenario) -> None:
    # The engines' latency alerts are test_live_dashboards.py's: on two shared CPU cores three
    # concurrent clients can slow the first token past its threshold, which says nothing
    # about the routing.
    active = [a for a in scenario.recorder.active_between(*scenario.routed)
              if a.name in ROUTING_RULES]  # fmt: skip
    assert active == [], f"routing alerts while routing was healthy: {active}"
    assert scenario.recorder.errors == []


@pytest.mark.parametrize(
    ("phase", "name", "pod"),
    [(phase, name, pod) for phase, alerts in PHASES.items() for name, pod in alerts.items()],
)
def test_routing_alert_fires_when_its_condition_is_caused(
    phase: str, name: str, pod: str | None, scenario: Scenario
) -> None:
    start, end = getattr(scenario, phase)
    seen = [a for a in scenario.recorder.seen if a.name == name and start <= a.at <= end]
    states = [a.state for a in seen]
    assert "pending" in states and "firing" in states, f"{name} during {phase}: {states}"
    assert states.index("pending") < states.index("firing")
    alert = next(a for a in seen if a.state == "firing")
    assert (alert.labels["namespace"], alert.labels["servingpolicy"]) == (NAMESPACE, SERVINGPOLICY)
    assert alert.labels["severity"] == ROUTING_RULES[name]["labels"]["severity"]
    if pod is not None:
        assert alert.labels["pod"] == pod


def test_the_worker_alert_names_the_stopped_replica(scenario: Scenario, fleet: Fleet) -> None:
    start, end = scenario.worker_down
    workers = {
        a.labels["worker"]
        for a in scenario.recorder.seen
        if a.name == "ArcServingRouterWorkerUnhealthy" and start <= a.at <= end
    }
    assert workers == {fleet.servers[1].url}


def test_every_routing_rule_of_the_chart_was_caused() -> None:
    assert {name for alerts in PHASES.values() for name in alerts} == set(ROUTING_RULES)


# ------------------------------------------------------------------------- dashboard
def evaluate(prometheus: PrometheusServer, expr: str, window: tuple[float, float]) -> list[Any]:
    """The range query Grafana sends for ``expr`` over ``window`` with every variable All."""
    intervals = Intervals.for_range(window[1] - window[0], SCRAPE_S)
    start, end = intervals.align(*window)
    return prometheus.query_range(expand(expr, intervals, ALL), start, end, intervals.interval_s)


def values(series: dict[str, Any]) -> list[float]:
    return [float(value) for _, value in series["values"] if math.isfinite(float(value))]


@pytest.mark.parametrize(
    "query", ROUTING_QUERIES, ids=[f"{q.panel}:{q.ref_id}" for q in ROUTING_QUERIES]
)
def test_routing_panel_returns_sane_data_on_routed_traffic(
    query: PanelQuery, scenario: Scenario, prometheus: PrometheusServer
) -> None:
    result = evaluate(prometheus, query.expr, scenario.routed)
    assert result, f"panel {query.panel!r} ({query.ref_id}) returned nothing"
    for series in result:
        numbers = values(series)
        assert numbers, f"{query.panel}: {series['metric']} has only NaN"
        assert all(v >= 0 for v in numbers), (query.panel, series["metric"], numbers)
        if query.unit == "percentunit":
            assert all(v <= 1 for v in numbers), (query.panel, series["metric"], numbers)
        if query.unit == "s":
            assert all(v > 0 for v in numbers), (query.panel, series["metric"], numbers)


def panel_result(
    prometheus: PrometheusServer, window: tuple[float, float], title: str
) -> list[list[dict[str, Any]]]:
    queries = [q for q in ROUTING_QUERIES if q.panel == title]
    assert queries, title
    return [evaluate(prometheus, q.expr, window) for q in queries]


def test_kv_aware_decides_by_prefix_cost_and_finds_cached_prefixes(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    (decisions,) = panel_result(prometheus, scenario.routed, "Routing decisions by outcome")
    outcomes = {(s["metric"]["policy"], s["metric"]["outcome"]) for s in decisions}
    assert outcomes == {("kv_aware", "prefix_cost")}
    (lookups,) = panel_result(prometheus, scenario.routed, "KV placement lookups")
    peak = {s["metric"]["result"]: max(values(s)) for s in lookups}
    # Every family's prefix is cached after its first request: most lookups hit.
    assert peak.get("hit", 0) > 0, peak


def test_worker_health_shows_both_replicas_healthy_while_routed(
    scenario: Scenario, prometheus: PrometheusServer, fleet: Fleet
) -> None:
    (health,) = panel_result(prometheus, scenario.routed, "Worker health per router")
    assert {s["metric"]["worker"]: set(values(s)) for s in health} == {
        server.url: {1.0} for server in fleet.servers
    }


def test_router_latency_quantiles_are_ordered(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    p50, p90, p99 = (
        {at: float(v) for at, v in result[0]["values"]}
        for result in panel_result(prometheus, scenario.routed, "Router latency")
    )
    common = [at for at in p50 if at in p90 and at in p99 and math.isfinite(p50[at])]
    assert common
    for at in common:
        assert 0 < p50[at] <= p90[at] <= p99[at], (at, p50[at], p90[at], p99[at])


def test_replica_hit_rates_split_during_the_skew(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    per_pod, per_servingpolicy = panel_result(
        prometheus, scenario.skew, "Prefix-cache hit rate per replica"
    )
    last = {s["metric"]["pod"]: values(s)[-1] for s in per_pod}
    (fleet_series,) = per_servingpolicy
    fleet_rate = values(fleet_series)[-1]
    assert last[PODS[1]] < 0.5 * fleet_rate < last[PODS[0]], (last, fleet_rate)


def test_router_series_carry_the_charts_labels(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    start, end = scenario.routed
    found = prometheus.query(
        f"max_over_time(vllm_router_worker_health[{math.ceil(end - start)}s])", at=end
    )
    assert found
    for series in found:
        labels = series["metric"]
        assert labels["namespace"] == NAMESPACE and labels["servingpolicy"] == SERVINGPOLICY
        assert (labels["pod"], labels["container"]) == (ROUTER_POD, "router")
