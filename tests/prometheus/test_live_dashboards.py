"""Every engine dashboard query and every engine alert rule of the chart, evaluated by a real
Prometheus on real data from the real vLLM server (CPU build) with the plugin (the router's are
tests/prometheus/test_live_routing.py's).

One vLLM server and one Prometheus (``.tools/bin/prometheus``, from ``make tools``) serve the
module. Prometheus scrapes the server every second through the scrape job the Prometheus
Operator builds from the chart's PodMonitor (``namespace``, ``pod``, ``container`` and the
chart's ``servingpolicy`` relabelling) and evaluates the chart's alert rules every second,
with every duration in them divided by 60 (``for: 15m`` becomes ``for: 15s``, ``[1h]`` and
``offset 1h`` become 60 s) so that each condition can hold for as long as it must within a
test; thresholds and the rest of the expressions are the chart's.

The scenario, run once in this order:

1. healthy: a Locust replay of a document-QA trace with two live policy switches
   (lru -> arc -> trio), far enough apart for two policy-switch marks; no alert may be
   pending or firing;
2. overload: 16 requests in flight with unique 61-block prompts, so requests queue, time to
   first token grows and nothing hits the cache any more; hit-rate drop, TTFT p99 and
   queueing alerts fire;
3. saturation: requests sharing a 61-block prefix pin the KV blocks while the policy is
   switched six times; the switch-flapping alert fires, the KV-cache alert goes pending;
4. down: the server is stopped; the engine-down alert fires.

Then every panel query of the overview and ARC-internals dashboards is evaluated over the
healthy replay as Grafana would send it (its variables, ``$__interval`` and
``$__rate_interval`` expanded by Grafana's rules for that time range and a 1 s scrape
interval) and must return data with sane values.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from arc_dev.snapshot import (
    Switch,
    annotation_events,
    duration_seconds,
    snapshot,
    switch_mark_problems,
)
from arc_harness.prometheus import (
    EngineTarget,
    Intervals,
    PanelQuery,
    PrometheusServer,
    dashboard_names,
    duration,
    expand,
    load_dashboard,
    panel_queries,
    pod_monitor_job,
)
from arc_harness.vllm_server import VllmServer, write_policy_file
from arc_loadtest.run import run_replay
from arc_serving_common.names import CONFIG_ENV, POLICY_NAMES, POLL_MS_ENV
from tests.chart.chart_helpers import ALERTS_FILE
from tests.faults.serving import BLOCK_TOKENS, docqa_trace
from tests.prometheus.live_stack import (
    AlertRecorder,
    complete,
    shared_prefix_prompts,
    shortened_rules,
    steady_load,
    unique_prompts,
)
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow, pytest.mark.exclusive]

SCRAPE_S = 1.0
RULE_TIME_FACTOR = 60
NAMESPACE, MONITOR, POD, SERVINGPOLICY = "llm", "rel-arc-serving-engine", "demo-engine-0", "demo"
CACHE_BLOCKS = 64  # cacheable blocks (the server gets one more, vLLM's null block)
# 100 requests 0.5 s apart: a 50 s replay, long enough to be the hour-earlier window of the
# hit-rate-drop alert (15 s window, 60 s offset, 15 s for) while the overload follows it.
REPLAY_REQUESTS, REPLAY_SPACING_S = 100, 0.5
OVERVIEW = load_dashboard("overview.json")
ANNOTATION = next(a for a in OVERVIEW["annotations"]["list"] if "expr" in a)
ANNOTATION_STEP_S = duration_seconds(ANNOTATION["step"])
SWITCH_COUNTER = "arc_evictor_policy_switches_total"
# The healthy replay's live switches: the first this far into it, each next one two
# annotation steps and two scrapes after the engine reported the one before, so that their
# marks (each within a scrape and a step of its switch) are more than a step apart and
# Grafana does not merge them into one region.
LIVE_SWITCHES, FIRST_SWITCH_S = ("arc", "trio"), 5.0
SWITCH_SPACING_S = 2 * ANNOTATION_STEP_S + 2 * SCRAPE_S
FLAPPING = ("arc", "s3fifo", "sieve", "dbl", "lru", "trio")
# 61 blocks of one request fill the cache, so unique prompts run one at a time and queue.
OVERLOAD_PROMPT_TOKENS, OVERLOAD_OUTPUT, OVERLOAD_IN_FLIGHT = 61 * BLOCK_TOKENS - 2, 16, 16
# A 61-block shared prefix plus one block of suffix and output per request: three requests
# run at once and the cache never has more than 3 free blocks while two of them do.
PREFIX_TOKENS, SUFFIX_TOKENS, SATURATION_OUTPUT, SATURATION_IN_FLIGHT = 61 * BLOCK_TOKENS, 8, 24, 6
# Bounds for a slow, busy machine; every wait ends as soon as what it waits for is seen.
ALERT_TIMEOUT_S = 300.0
SWITCH_TIMEOUT_S = 120.0

# Alert -> the state each phase must bring it to. vLLM sets vllm:kv_cache_usage_perc once per
# engine step, and on this tiny CPU model requests are so short that the gauge reads 0 between
# them every few seconds: above 0.95 it stays for seconds (pending), not for the 15 s of its
# shortened for: (firing).
OVERLOAD_ALERTS = {
    "ArcServingPrefixCacheHitRateDrop": "firing",
    "ArcServingTTFTP99High": "firing",
    "ArcServingRequestsQueued": "firing",
}
SATURATION_ALERTS = {
    "ArcServingKVCacheSaturated": "pending",
    "ArcServingPolicySwitchFlapping": "firing",
}
DOWN_ALERTS = {"ArcServingEngineDown": "firing"}
PHASES = {"overload": OVERLOAD_ALERTS, "saturation": SATURATION_ALERTS, "down": DOWN_ALERTS}
CHART_RULES = yaml.safe_load(ALERTS_FILE.read_text(encoding="utf-8"))["groups"]
RULES = {rule["alert"]: rule for group in CHART_RULES for rule in group["rules"]}
# The TTFT p99 above which ArcServingTTFTP99High fires, in seconds (its expression's bound).
TTFT_ALERT_S = float(re.search(r">\s*([0-9.]+)\s*$", RULES["ArcServingTTFTP99High"]["expr"])[1])
MAX_IN_FLIGHT = 128
# The router's rules and dashboard need a router in front of several engines:
# tests/prometheus/test_live_routing.py causes and evaluates them on a local fleet.
ROUTING_GROUP, ROUTING_DASHBOARD = "arc-serving.routing", "routing.json"
ENGINE_RULES = {
    rule["alert"] for group in CHART_RULES if group["name"] != ROUTING_GROUP
    for rule in group["rules"]
}  # fmt: skip
DASHBOARD_QUERIES = [
    (name, query) for name in dashboard_names() if name != ROUTING_DASHBOARD
    for query in panel_queries(load_dashboard(name))
]  # fmt: skip
ALL = {"namespace": None, "servingpolicy": None, "pod": None}


@dataclass(slots=True)
class Scenario:
    """When each phase ran, what was switched, and every alert state seen meanwhile."""

    healthy: tuple[float, float]
    switches: list[Switch]
    overload: tuple[float, float]
    saturation: tuple[float, float]
    down: tuple[float, float]
    recorder: AlertRecorder
    replay_summary: dict[str, Any]
    load_errors: list[str]


def active_policy(server: VllmServer) -> str | None:
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "arc_evictor_policy_info" and sample.value == 1:
                return sample.labels["policy"]
    return None


def switch(server: VllmServer, path: Path, policy: str) -> Switch:
    """Switch the engine to ``policy``; returns when it reports it, with when it was written."""
    written = time.time()
    write_policy_file(path, policy)
    deadline = time.monotonic() + SWITCH_TIMEOUT_S
    while active_policy(server) != policy:
        assert time.monotonic() < deadline, f"the engine did not switch to {policy}"
        time.sleep(0.1)
    return Switch(policy, written, time.time())


def overload_in_flight(server: VllmServer, prompts: Iterator[list[int]]) -> int:
    """How many overload requests to keep in flight so that queueing alone puts their time to
    first token at three times the TTFT alert's threshold, however fast this machine: the
    cache holds one overload prompt at a time, so each waits for every one ahead of it. One
    request is timed alone first."""
    started = time.monotonic()
    complete(server, next(prompts), OVERLOAD_OUTPUT)
    alone = time.monotonic() - started
    return min(MAX_IN_FLIGHT, max(OVERLOAD_IN_FLIGHT, math.ceil(3 * TTFT_ALERT_S / alone) + 1))


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("live-config") / "policy.json"
    write_policy_file(path, "lru")
    return path


@pytest.fixture(scope="module")
def server(
    model_dir: Path, policy_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("live-vllm") / "vllm.log"
    env = {CONFIG_ENV: str(policy_file), POLL_MS_ENV: "100"}
    with VllmServer(model_dir, block_size=BLOCK_TOKENS, num_gpu_blocks=CACHE_BLOCKS + 1,
                    env=env, log_path=log) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def prometheus(server: VllmServer) -> Iterator[PrometheusServer]:
    target = EngineTarget(f"127.0.0.1:{server.port}", NAMESPACE, POD, SERVINGPOLICY)
    job = pod_monitor_job(NAMESPACE, MONITOR, [target], SCRAPE_S)
    rules = {"alerts.yaml": shortened_rules(CHART_RULES, RULE_TIME_FACTOR)}
    with PrometheusServer([job], rule_files=rules, evaluation_interval_s=SCRAPE_S) as prom:
        # Static targets reach the scrape manager within its 5 s discovery update period.
        prom.wait_until(lambda: prom.query("arc_evictor_policy_info == 1") != [], ALERT_TIMEOUT_S,
                        "the engine's first scrape")  # fmt: skip
        yield prom


@pytest.fixture(scope="module")
def scenario(
    server: VllmServer,
    prometheus: PrometheusServer,
    policy_file: Path,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scenario]:
    work = tmp_path_factory.mktemp("live-run")
    trace = docqa_trace(work / "trace.jsonl", count=REPLAY_REQUESTS, spacing_s=REPLAY_SPACING_S)
    # The annotation marks a switch only where the counter has a sample a step before it.
    history = f"{SWITCH_COUNTER} offset {duration(ANNOTATION_STEP_S + SCRAPE_S)}"
    prometheus.wait_until(lambda: prometheus.query(history) != [], ALERT_TIMEOUT_S,
                          "a step of the switch counter's history")  # fmt: skip
    recorder = AlertRecorder(prometheus)
    recorder.start()
    switches: list[Switch] = []
    load_errors: list[str] = []
    try:
        # 1. healthy replay with live switches
        started = time.time()
        stop = threading.Event()

        def switcher() -> None:
            due = started + FIRST_SWITCH_S
            for policy in LIVE_SWITCHES:
                if stop.wait(max(0.0, due - time.time())):
                    return
                switches.append(switch(server, policy_file, policy))
                due = switches[-1].reported + SWITCH_SPACING_S

        writer = threading.Thread(target=switcher, daemon=True)
        writer.start()
        try:
            replay = run_replay(server.base_url, trace, out_dir=work / "replay",
                                run_time_s=replay_run_time_s(trace, block_tokens=BLOCK_TOKENS),
                                api_key=server.api_key, block_tokens=BLOCK_TOKENS,
                                tokenizer=model_dir)  # fmt: skip
        finally:
            stop.set()
            writer.join(timeout=SWITCH_TIMEOUT_S + 5)
        healthy = (started, time.time())
        assert replay.exit_code == 0 and replay.summary is not None, replay.log[-3000:]

        # 2. overload: queueing, slow first tokens, no cache hits
        overload_start = time.time()
        prompts = unique_prompts(OVERLOAD_PROMPT_TOKENS, seed=1)
        in_flight = overload_in_flight(server, prompts)
        with steady_load(server, prompts, OVERLOAD_OUTPUT, in_flight) as errors:
            recorder.wait_for(OVERLOAD_ALERTS, overload_start, ALERT_TIMEOUT_S)
        load_errors += errors
        overload = (overload_start, time.time())

        # 3. saturation: every KV block pinned by requests sharing a prefix, policy flapping. It
        # starts with its alerts inactive: where requests decode fast, the overload's one-at-a-
        # time prompts keep the cache full long enough for the saturation alert to fire there.
        recorder.wait_until_inactive(SATURATION_ALERTS, ALERT_TIMEOUT_S)
        saturation_start = time.time()
        prompts = shared_prefix_prompts(PREFIX_TOKENS, SUFFIX_TOKENS, seed=2)
        with steady_load(server, prompts, SATURATION_OUTPUT, SATURATION_IN_FLIGHT) as errors:
            for policy in FLAPPING:
                switches.append(switch(server, policy_file, policy))
            recorder.wait_for(SATURATION_ALERTS, saturation_start, ALERT_TIMEOUT_S)
        load_errors += errors
        saturation = (saturation_start, time.time())

        # 4. the engine goes away
        down_start = time.time()
        server.stop()
        recorder.wait_for(DOWN_ALERTS, down_start, ALERT_TIMEOUT_S)
        down = (down_start, time.time())
    finally:
        recorder.stop()
    yield Scenario(healthy, switches, overload, saturation, down, recorder, replay.summary,
                   load_errors)  # fmt: skip


# ----------------------------------------------------------------------------- alerts
def test_healthy_replay_answers_everything_and_raises_no_alert(scenario: Scenario) -> None:
    summary = scenario.replay_summary
    assert (summary["requests_ok"], summary["requests_failed"]) == (REPLAY_REQUESTS, 0)
    assert [s.policy for s in scenario.switches[: len(LIVE_SWITCHES)]] == list(LIVE_SWITCHES)
    active = scenario.recorder.active_between(*scenario.healthy)
    # What the replay measured says how far the server was from the latency alert's 2 s.
    measured = {key: summary[key] for key in ("ttft_s", "dispatch_lag_s")}
    assert active == [], f"alerts during the healthy replay: {active}; measured {measured}"
    print(f"healthy replay: no alert; measured {measured}")
    assert scenario.recorder.errors == []
    assert scenario.load_errors == []


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_condition_is_false_on_the_healthy_replay(
    name: str, scenario: Scenario, prometheus: PrometheusServer
) -> None:
    expr = shortened_rules(CHART_RULES, RULE_TIME_FACTOR)
    rule = next(r for g in expr["groups"] for r in g["rules"] if r["alert"] == name)
    start, end = scenario.healthy
    assert prometheus.query_range(rule["expr"], start, end, SCRAPE_S) == []


@pytest.mark.parametrize(
    ("name", "phase", "state"),
    [(name, phase, state) for phase, alerts in PHASES.items() for name, state in alerts.items()],
)
def test_alert_reaches_its_state_when_its_condition_is_caused(
    name: str, phase: str, state: str, scenario: Scenario
) -> None:
    start, end = getattr(scenario, phase)
    seen = [a for a in scenario.recorder.seen if a.name == name and start <= a.at <= end]
    states = [a.state for a in seen]
    assert "pending" in states, f"{name} during {phase}: {states}"
    if state == "firing":
        assert "firing" in states, f"{name} during {phase}: {states}"
        assert states.index("pending") < states.index("firing")
    alert = next(a for a in seen if a.state == state)
    assert alert.labels["namespace"] == NAMESPACE
    assert alert.labels["servingpolicy"] == SERVINGPOLICY
    assert alert.labels["severity"] == RULES[name]["labels"]["severity"]
    if name in ("ArcServingKVCacheSaturated", "ArcServingEngineDown"):
        assert alert.labels["pod"] == POD


def test_every_engine_rule_of_the_chart_was_caused() -> None:
    assert {name for alerts in PHASES.values() for name in alerts} == ENGINE_RULES


# ------------------------------------------------------------------------- dashboards
def series_values(series: dict[str, Any]) -> list[float]:
    return [float(value) for _, value in series["values"]]


def finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def evaluate(
    prometheus: PrometheusServer,
    expr: str,
    window: tuple[float, float],
    selection: dict[str, list[str] | None],
    min_step_s: float = 0.0,
) -> list[dict[str, Any]]:
    """The range query Grafana sends for ``expr`` over ``window`` and the variables chosen."""
    intervals = Intervals.for_range(window[1] - window[0], SCRAPE_S, min_step_s)
    start, end = intervals.align(*window)
    return prometheus.query_range(
        expand(expr, intervals, selection), start, end, intervals.interval_s
    )


def by_time(result: list[dict[str, Any]], legend_label: str) -> dict[float, dict[str, float]]:
    """{timestamp: {series label value: value}} of a range result."""
    table: dict[float, dict[str, float]] = {}
    for series in result:
        for at, value in series["values"]:
            table.setdefault(at, {})[series["metric"].get(legend_label, "")] = float(value)
    return table


def sanity_problems(query: PanelQuery, result: list[dict[str, Any]]) -> list[str]:
    """What is wrong with one panel query's data for a dashboard reader."""
    problems = []
    for series in result:
        values = finite(series_values(series))
        if not values:
            problems.append(f"series {series['metric']} has no number, only NaN")
        elif query.unit == "percentunit" and not all(0 <= v <= 1 for v in values):
            problems.append(f"{series['metric']}: a fraction outside [0, 1]: {values}")
        elif query.unit == "s" and not all(v > 0 for v in values):
            problems.append(f"{series['metric']}: a latency <= 0: {values}")
        elif not all(v >= 0 for v in values):
            problems.append(f"{series['metric']}: a negative value: {values}")
    if "policy" in query.legend:
        policies = {series["metric"].get("policy") for series in result}
        if not policies <= set(POLICY_NAMES):
            problems.append(f"policies nobody registered: {policies}")
    return problems


@pytest.mark.parametrize(
    ("dashboard", "query"),
    DASHBOARD_QUERIES,
    ids=[f"{name.removesuffix('.json')}:{q.panel}:{q.ref_id}" for name, q in DASHBOARD_QUERIES],
)
@pytest.mark.parametrize("selection", ["all", "one"])
def test_panel_query_returns_sane_data_on_the_replay(
    dashboard: str,
    query: PanelQuery,
    selection: str,
    scenario: Scenario,
    prometheus: PrometheusServer,
) -> None:
    chosen = ALL if selection == "all" else variables(prometheus, scenario.healthy)
    result = evaluate(prometheus, query.expr, scenario.healthy, chosen)
    assert result, f"{dashboard} panel {query.panel!r} ({query.ref_id}) returned nothing"
    problems = sanity_problems(query, result)
    assert not problems, f"{dashboard} panel {query.panel!r} ({query.ref_id}): {problems}"


def variables(
    prometheus: PrometheusServer, window: tuple[float, float]
) -> dict[str, list[str] | None]:
    """Each variable's options (label_values over the range), the first one chosen in turn."""
    chosen: dict[str, list[str] | None] = {}
    dashboard = load_dashboard("overview.json")
    intervals = Intervals.for_range(window[1] - window[0], SCRAPE_S)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        series, label = variable["definition"].removeprefix("label_values(")[:-1].rsplit(", ", 1)
        match = expand(series, intervals, chosen | {n: None for n in ALL if n not in chosen})
        options = sorted({s[label] for s in prometheus.series(match, *window) if label in s})
        chosen[variable["name"]] = options[:1]
    return chosen


def test_variables_offer_the_engine_labels(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    assert variables(prometheus, scenario.healthy) == {
        "namespace": [NAMESPACE],
        "servingpolicy": [SERVINGPOLICY],
        "pod": [POD],
    }


def overview_result(
    prometheus: PrometheusServer, scenario: Scenario, panel: str
) -> list[list[dict[str, Any]]]:
    queries = [q for q in panel_queries(load_dashboard("overview.json"))
               if q.panel == panel]  # fmt: skip
    assert queries, panel
    return [evaluate(prometheus, q.expr, scenario.healthy, ALL) for q in queries]


def test_ttft_quantiles_are_ordered(scenario: Scenario, prometheus: PrometheusServer) -> None:
    p50, p90, p99 = (
        {at: float(v) for at, v in result[0]["values"]}
        for result in overview_result(prometheus, scenario, "Time to first token")
    )
    common = [at for at in p50 if at in p90 and at in p99 and math.isfinite(p50[at])]
    assert len(common) >= 10
    for at in common:
        assert 0 < p50[at] <= p90[at] <= p99[at], (at, p50[at], p90[at], p99[at])


def test_one_active_policy_per_pod_following_the_switches(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    (result,) = overview_result(prometheus, scenario, "Active policy per pod")
    table = by_time(result, "policy")
    assert all(len(policies) == 1 for policies in table.values()), table
    order = [next(iter(table[at])) for at in sorted(table)]
    changes = [p for i, p in enumerate(order) if i == 0 or p != order[i - 1]]
    assert changes == ["lru", "arc", "trio"]


def test_hit_rate_per_policy_shows_each_policy_that_ran(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    (result,) = overview_result(prometheus, scenario, "Prefix-cache hit rate per policy")
    policies = {series["metric"]["policy"] for series in result}
    assert policies == {"lru", "arc", "trio"}
    # The trace repeats documents: once warm, most prompt tokens hit.
    best = max(max(finite(series_values(series)), default=0) for series in result)
    assert best > 0.5


def test_policy_switch_annotation_marks_each_switch_once(
    scenario: Scenario, prometheus: PrometheusServer
) -> None:
    """Each live switch shows as one mark within one scrape and one annotation step after it,
    as a reader of the last hour sees it; no other mark before the saturation phase's
    switches."""
    now = time.time()
    result = evaluate(prometheus, ANNOTATION["expr"], (now - 3600, now), ALL,
                      min_step_s=ANNOTATION_STEP_S)  # fmt: skip
    assert {(s["metric"]["namespace"], s["metric"]["pod"]) for s in result} == {(NAMESPACE, POD)}
    marks = annotation_events(prometheus, OVERVIEW, now - 3600, now, SCRAPE_S)
    assert {mark.step_s for mark in marks} == {ANNOTATION_STEP_S}
    before_flapping = [mark for mark in marks if mark.time < scenario.saturation[0]]
    live = scenario.switches[: len(LIVE_SWITCHES)]
    assert switch_mark_problems(live, before_flapping, SCRAPE_S) == []


def test_snapshot_draws_every_overview_panel_and_a_mark_per_switch(
    scenario: Scenario, prometheus: PrometheusServer, tmp_path: Path
) -> None:
    path = tmp_path / "dashboards.png"
    drawn = snapshot(prometheus, OVERVIEW, *scenario.healthy, SCRAPE_S, path)
    panels = drawn.panels
    assert [p.title for p in panels] == [
        p["title"] for p in OVERVIEW["panels"] if p["type"] != "row"
    ]
    assert all(panel.lines for panel in panels), [p.title for p in panels if not p.lines]
    timeline = next(p for p in panels if p.kind == "state-timeline")
    assert {line.legend for line in timeline.lines} >= {f"{NAMESPACE}/{POD}: trio"}
    live = scenario.switches[: len(LIVE_SWITCHES)]
    assert switch_mark_problems(live, drawn.marks, SCRAPE_S) == []
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
