"""The routing dashboard and the router's alert rules of the chart, evaluated by a real
Prometheus on real data from a local fleet: two real vLLM servers (CPU build, the plugin, KV
events) behind the real vllm-router with the kv_aware policy (``arc_harness.fleet``, ports
27200-27291).

Prometheus scrapes the engines through the scrape job the Prometheus Operator builds from the
chart's engine PodMonitor and the router's ``--prometheus-port`` through the one it builds from
the chart's router PodMonitor (container ``router``, port ``metrics``), every second, and
evaluates the chart's alert rules with every duration divided by 60, as
tests/prometheus/test_live_dashboards.py does for the engines.

The scenario, run once in this order:

1. routed: three clients, one per shared prefix, send through the router without pause until
   the hit-rate rule has been evaluated, on windows that begin after each prefix's first
   (cold) request, for its ``for:`` duration and a few evaluations more; the test reads each
   server's own counters meanwhile. From them it judges, at each of those evaluations and
   over the rule's own window, whether a replica hit under half of the fleet's rate: routing
   was healthy if none did, and the alert must agree with that judgement wherever it is clear
   (unchanged by moving the window's ends by two scrape intervals). No router alert fires,
   as the router's own counters say none should, and every routing-dashboard query
   must return sane data over this window;
2. skew: sent straight to the engines, replica 0 gets prompts it has cached, replica 1 prompts
   nobody has; the per-replica hit-rate alert fires for replica 1, and agrees with the
   servers' counters here too, where its condition holds;
3. fallback: clients ask the router for /tokenize, whose prompt it cannot route by prefix;
   the load-balancing fallback alert fires;
4. worker down: replica 1 stops; the router's health checks fail and its worker alert fires;
5. router down: the router stops; the router-down alert fires.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from arc_harness.fleet import SERVED_MODEL, Fleet, FleetServer, Samples
from arc_harness.prometheus import (
    EngineTarget,
    Intervals,
    PanelQuery,
    PrometheusServer,
    expand,
    load_dashboard,
    panel_queries,
    pod_monitor_job,
)
from tests.chart.chart_helpers import ALERTS_FILE
from tests.prometheus.live_stack import (
    SECONDS,
    AlertRecorder,
    Evaluation,
    EvaluationRecorder,
    router_monitor_job,
    shared_prefix_prompts,
    shortened_rules,
    unique_prompts,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.exclusive]

SCRAPE_S = 1.0
RULE_TIME_FACTOR = 60
PORT_BASE = 27200  # the fleet's servers on 27200 and 27210, its router on 27290 and 27291
NAMESPACE, SERVINGPOLICY = "llm", "chat"
ENGINE_MONITOR, ROUTER_MONITOR = "rel-arc-serving-engine", "rel-arc-serving-router"
PODS, ROUTER_POD = ("chat-0", "chat-1"), "chat-router-0"
CAPACITY_BLOCKS = 64
PREFIX_TOKENS, SUFFIX_TOKENS = 4 * 32, 8  # four full 32-token blocks shared, then a suffix
FAMILIES = 3
# Bounds for a slow, busy machine: each phase ends as soon as what it waits for is seen.
ALERT_TIMEOUT_S = 300.0
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
HIT_RATE_ALERT = "ArcServingReplicaHitRateLow"
ROUTER_ALERTS = sorted(set(ROUTING_RULES) - {HIT_RATE_ALERT})
# The decision outcomes ArcServingRoutingFallback counts as falling back to load.
FALLBACK_OUTCOMES = re.findall(
    r'outcome=~"([^"]+)"', ROUTING_RULES["ArcServingRoutingFallback"]["expr"]
)[0].split("|")


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)", duration)
    assert match, duration
    return int(match.group(1)) * SECONDS[match.group(2)]


# The hit-rate rule as Prometheus runs it here: its rate window and ``for:`` divided by
# RULE_TIME_FACTOR, and its factor (a replica under FACTOR times its ServingPolicy's rate).
RATE_WINDOW_S = (
    max(seconds(d) for d in re.findall(r"\[(\w+)\]", ROUTING_RULES[HIT_RATE_ALERT]["expr"]))
    / RULE_TIME_FACTOR
)
FOR_S = seconds(ROUTING_RULES[HIT_RATE_ALERT]["for"]) / RULE_TIME_FACTOR
FACTOR = float(
    re.findall(r"group_left \(\)\s+([\d.]+) \*", ROUTING_RULES[HIT_RATE_ALERT]["expr"])[0]
)
# How far the test's readings of the servers and Prometheus's scrapes and evaluations of the
# same moment may lie apart; a judgement that moving the window's ends by this much changes
# is not clear, and the alert is not compared with it.
SLACK_S = 2 * SCRAPE_S
# How far Prometheus's ratio of a pod's rate to its fleet's may lie from the counters' plain
# increases: rate() extrapolates each pod's increase from its own first and last scrape in the
# window to the window's ends, about one scrape interval at each end, which weighs the pods of
# the fleet's sum differently. A pod this close to the threshold is not a clear judgement.
SHARE_SLACK = 2 * SCRAPE_S / RATE_WINDOW_S
# Judged evaluations the healthy window must hold: enough for a condition that held
# throughout to take the alert to firing, and a few more.
JUDGED_EVALUATIONS = math.ceil(FOR_S / SCRAPE_S) + 5
PHASES = {
    "skew": {"ArcServingReplicaHitRateLow": PODS[1]},
    "fallback": {"ArcServingRoutingFallback": None},
    "worker_down": {"ArcServingRouterWorkerUnhealthy": ROUTER_POD},
    "router_down": {"ArcServingRouterDown": ROUTER_POD},
}
ROUTING_QUERIES = panel_queries(load_dashboard(ROUTING_DASHBOARD))
ALL = {"namespace": None, "servingpolicy": None, "pod": None}


@dataclass(frozen=True, slots=True)
class Reading:
    """One reading of one server's counters, taken by the test itself."""

    at: float
    hits: float  # vllm:prefix_cache_hits_total (prompt tokens)
    queries: float  # vllm:prefix_cache_queries_total
    requests: float  # vllm:request_success_total


@dataclass(slots=True)
class CounterSampler:
    """Reads every server's /metrics in a thread, every ``poll_s``, until stopped."""

    servers: Sequence[FleetServer]
    poll_s: float = 0.25
    readings: dict[str, list[Reading]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for server, pod in zip(self.servers, PODS, strict=True):
                stats = server.stats()
                if stats.hit_tokens is not None and stats.query_tokens is not None:
                    reading = Reading(time.time(), stats.hit_tokens, stats.query_tokens,
                                      stats.requests or 0.0)  # fmt: skip
                    self.readings.setdefault(pod, []).append(reading)
            if self._stop.wait(self.poll_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


@dataclass(frozen=True, slots=True)
class Counts:
    hits: float
    queries: float
    requests: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan


def counts(readings: Sequence[Reading], start: float, end: float) -> Counts:
    """What a server's counters grew by between ``start`` and ``end`` (its readings then)."""

    def at(moment: float) -> Reading:
        return max((r for r in readings if r.at <= moment), key=lambda r: r.at,
                   default=readings[0])  # fmt: skip

    first, last = at(start), at(end)
    return Counts(last.hits - first.hits, last.queries - first.queries,
                  last.requests - first.requests)  # fmt: skip


def threshold_shares(readings: dict[str, list[Reading]], start: float, end: float
                     ) -> dict[str, float]:  # fmt: skip
    """Each pod's hit rate over ``start`` .. ``end`` divided by FACTOR times the fleet's, from
    the servers' own counters: under 1 is the hit-rate rule's condition. A pod that served no
    prompt token has no rate and is left out, as in the rule."""
    per_pod = {pod: counts(found, start, end) for pod, found in readings.items()}
    fleet = Counts(*(sum(getattr(c, f) for c in per_pod.values())
                     for f in ("hits", "queries", "requests")))  # fmt: skip
    threshold = FACTOR * fleet.hit_rate
    return {pod: c.hit_rate / threshold if threshold else math.inf
            for pod, c in per_pod.items() if c.queries}  # fmt: skip


def low_replicas(readings: dict[str, list[Reading]], start: float, end: float) -> set[str]:
    """The pods the hit-rate rule's condition holds for over ``start`` .. ``end``."""
    return {pod for pod, share in threshold_shares(readings, start, end).items() if share < 1}


def judgement(readings: dict[str, list[Reading]], at: float) -> set[str] | None:
    """The pods the rule's condition holds for at the evaluation at ``at``, over the rule's
    window; None when moving either end of the window by SLACK_S changes the answer, or when
    a pod's rate lies within SHARE_SLACK of the threshold."""
    shares = [
        threshold_shares(readings, at - RATE_WINDOW_S + start, at + end)
        for start in (-SLACK_S, SLACK_S)
        for end in (-SLACK_S, SLACK_S)
    ]
    if any(abs(share - 1) < SHARE_SLACK for found in shares for share in found.values()):
        return None
    found = {frozenset(pod for pod, share in each.items() if share < 1) for each in shares}
    return set(next(iter(found))) if len(found) == 1 else None


def router_fallbacks(samples: Samples) -> float:
    """The router's decisions so far that fell back to load (its own counter)."""
    decisions = samples.get("vllm_router_prefix_routing_decisions_total", [])
    return sum(value for labels, value in decisions if labels.get("outcome") in FALLBACK_OUTCOMES)


@dataclass(slots=True)
class Healthy:
    """The healthy window: what the test read of the servers and the router, and each
    evaluation of the routing rules."""

    judged: tuple[float, float]  # evaluations here have their whole rate window after warm-up
    readings: dict[str, list[Reading]]
    evaluations: EvaluationRecorder
    router_before: Samples
    router_after: Samples

    def judged_evaluations(self, name: str = HIT_RATE_ALERT) -> list[Evaluation]:
        return self.evaluations.of(name, *self.judged)

    def describe(self) -> str:
        """Each replica's share of the requests and hit rate over the judged window."""
        start, end = self.judged[0] - RATE_WINDOW_S, self.judged[1]
        per_pod = {pod: counts(found, start, end) for pod, found in self.readings.items()}
        total = sum(c.requests for c in per_pod.values()) or 1
        hits = sum(c.hits for c in per_pod.values())
        queries = sum(c.queries for c in per_pod.values()) or 1
        return (
            ", ".join(
                f"{pod}: {c.requests:.0f} requests ({c.requests / total:.0%}), hit rate "
                f"{c.hit_rate:.2f}"
                for pod, c in sorted(per_pod.items())
            )
            + f"; fleet hit rate {hits / queries:.2f}"
        )


@dataclass(slots=True)
class Scenario:
    """When each phase ran and every alert state seen meanwhile."""

    routed: tuple[float, float]
    healthy: Healthy
    skew: tuple[float, float]
    fallback: tuple[float, float]
    worker_down: tuple[float, float]
    router_down: tuple[float, float]
    recorder: AlertRecorder


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("routing-fleet")
    with Fleet(model_dir, work_dir=work, replicas=2, policy="kv_aware", port_base=PORT_BASE,
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
        prom.wait_until(lambda: len(prom.query("up == 1")) == 3, ALERT_TIMEOUT_S,
                        "the first scrapes")  # fmt: skip
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


def engines_scraped_since(prometheus: PrometheusServer, moment: float) -> bool:
    """Whether Prometheus holds a scrape of every engine taken after ``moment``."""
    found = prometheus.query(f'timestamp(up{{job="{NAMESPACE}/{ENGINE_MONITOR}"}})')
    return len(found) == len(PODS) and all(float(s["value"][1]) > moment for s in found)


def routed_traffic(
    fleet: Fleet,
    prometheus: PrometheusServer,
    sampler: CounterSampler,
    evaluations: EvaluationRecorder,
) -> tuple[tuple[float, float], Healthy]:
    """Phase 1: one client per prefix family at once, so that the router weighs cached
    prefixes against load and both replicas get requests, until every routing rule has been
    evaluated JUDGED_EVALUATIONS times on windows that begin after every family's first
    request was answered (its prefix cached: the cold misses are behind the windows)."""
    start = time.time()
    router_before = fleet.router.metrics()
    stop = threading.Event()
    answered = [0] * FAMILIES

    def client(family: int) -> None:
        prompts = shared_prefix_prompts(PREFIX_TOKENS, SUFFIX_TOKENS, family)
        while not stop.is_set():
            complete(fleet, fleet.router.url, next(prompts))
            answered[family] += 1

    def judged_so_far(warm: float) -> int:
        # The fewest of any routing rule: a poll can land between two rules' evaluations in
        # one pass of the group, and the next poll, late on a busy machine, after the pass
        # that follows; one rule then misses an evaluation the others have.
        window = (warm + RATE_WINDOW_S + SLACK_S, time.time() - SLACK_S)
        return min(len(evaluations.of(name, *window)) for name in ROUTING_RULES)

    def clients_failed() -> None:
        """Raise a client's error (or say that one stopped) while the phase waits."""
        for future in clients:
            if future.done():
                future.result()
                raise AssertionError("a client stopped sending")

    pool = ThreadPoolExecutor(FAMILIES)
    try:
        clients = [pool.submit(client, family) for family in range(FAMILIES)]
        prometheus.wait_until(lambda: clients_failed() or min(answered) > 0, ALERT_TIMEOUT_S,
                              "an answer for every prefix family")  # fmt: skip
        warm = time.time()
        prometheus.wait_until(
            lambda: clients_failed() or judged_so_far(warm) >= JUDGED_EVALUATIONS,
            ALERT_TIMEOUT_S,
            f"{JUDGED_EVALUATIONS} evaluations of every routing rule after the warm-up",
        )
    finally:
        stop.set()
        pool.shutdown(wait=True)
    for future in clients:
        future.result()
    traffic_end = time.time()
    # The routed window ends once Prometheus scraped the engines after the last answer, so
    # that every request reaches the dashboards' rate windows.
    prometheus.wait_until(lambda: engines_scraped_since(prometheus, traffic_end),
                          ALERT_TIMEOUT_S, "a scrape after the routed traffic")  # fmt: skip
    judged = (warm + RATE_WINDOW_S + SLACK_S, traffic_end - SLACK_S)
    healthy = Healthy(judged, sampler.readings, evaluations, router_before,
                      fleet.router.metrics())  # fmt: skip
    return (start, time.time()), healthy


@pytest.fixture(scope="module")
def scenario(fleet: Fleet, prometheus: PrometheusServer) -> Iterator[Scenario]:
    recorder = AlertRecorder(prometheus)
    recorder.start()
    # The servers' counters and the routing rules' evaluations through phases 1 and 2.
    sampler = CounterSampler(fleet.servers)
    evaluations = EvaluationRecorder(prometheus, ROUTING_GROUP)
    sampler.start()
    evaluations.start()
    try:
        # 1. routed traffic, judged from the servers' counters
        routed, healthy = routed_traffic(fleet, prometheus, sampler, evaluations)

        # 2. skew: replica 0 serves a prefix it has cached, replica 1 prompts nobody has
        cached = shared_prefix_prompts(PREFIX_TOKENS, SUFFIX_TOKENS, seed=0)
        fresh = unique_prompts(PREFIX_TOKENS + SUFFIX_TOKENS, seed=FAMILIES)

        def skewed() -> None:
            complete(fleet, fleet.servers[0].url, next(cached))
            complete(fleet, fleet.servers[1].url, next(fresh))

        skew = until_firing(recorder, "ArcServingReplicaHitRateLow", time.time(), skewed)
        sampler.stop()
        evaluations.stop()

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
        sampler.stop()
        evaluations.stop()
        recorder.stop()
    yield Scenario(routed, healthy, skew, fallback, worker_down, router_down, recorder)


# ----------------------------------------------------------------------------- alerts
def test_routed_traffic_was_healthy_by_the_servers_counters(scenario: Scenario) -> None:
    healthy = scenario.healthy
    judged = healthy.judged_evaluations()
    assert len(judged) >= JUDGED_EVALUATIONS, (healthy.judged, len(judged))
    low = {e.at: low_replicas(healthy.readings, e.at - RATE_WINDOW_S, e.at) for e in judged}
    low = {at: pods for at, pods in low.items() if pods}
    # A replica under half the fleet's hit rate after the warm-up: the router sent it
    # prefixes that the other replica holds. That is the routing's fault, not the alert's.
    assert low == {}, f"routing was not healthy at {sorted(low.items())}: {healthy.describe()}"
    print(f"routed traffic, {len(judged)} evaluations judged: {healthy.describe()}")


def test_hit_rate_alert_agrees_with_the_servers_counters(scenario: Scenario) -> None:
    # Over the healthy window and the skew after it, so that the comparison sees the
    # condition both false and true.
    healthy = scenario.healthy
    compared, low, disagreements = 0, 0, []
    window = (healthy.judged[0], scenario.skew[1] - SLACK_S)
    for evaluation in healthy.evaluations.of(HIT_RATE_ALERT, *window):
        expected = judgement(healthy.readings, evaluation.at)
        if expected is None:
            continue
        compared += 1
        low += bool(expected)
        active = {a.labels["pod"]: f"{a.state} at {float(a.value):.2f}" if a.value else a.state
                  for a in evaluation.alerts}  # fmt: skip
        if set(active) != expected:
            disagreements.append((evaluation.at, sorted(expected), active))
    assert disagreements == [], f"{disagreements}: {healthy.describe()}"
    assert compared >= JUDGED_EVALUATIONS and low > 0, f"{compared} clear judgements, {low} low"
    print(f"{HIT_RATE_ALERT}: {compared} evaluations compared, {low} with a replica low")
    assert healthy.evaluations.errors == []


def test_router_alerts_stay_quiet_while_the_router_routes_by_prefix(
    scenario: Scenario, fleet: Fleet
) -> None:
    healthy = scenario.healthy
    # What the router's own counters say: no decision fell back to load, every worker healthy.
    assert router_fallbacks(healthy.router_after) == router_fallbacks(healthy.router_before)
    health = {labels["worker"]: value for labels, value in
              healthy.router_after.get("vllm_router_worker_health", [])}  # fmt: skip
    assert health == {server.url: 1.0 for server in fleet.servers}
    for name in ROUTER_ALERTS:
        judged = healthy.judged_evaluations(name)
        assert len(judged) >= JUDGED_EVALUATIONS, (name, len(judged))
        # One scrape that outlasts its 1 s timeout on a busy machine makes the router-down
        # rule pending for an evaluation; its ``for:`` is there to absorb that. What pages
        # someone is a firing alert.
        firing = [a for e in judged for a in e.alerts if a.state == "firing"]
        assert firing == [], f"{name} while the router routed by prefix: {firing}"
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
