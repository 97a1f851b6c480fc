"""The pieces the live dashboard tests rely on, checked without a server: the scrape jobs
match the chart's PodMonitors, the rules are shortened mechanically, and Grafana's variables
expand by Grafana's rules."""

from __future__ import annotations

from typing import Any

import yaml

from arc_harness.prometheus import (
    CHART_RELABELINGS,
    EngineTarget,
    Intervals,
    expand,
    pod_monitor_job,
    variable_value,
)
from arc_operator.manifests import ROUTER_CONTAINER, ROUTER_METRICS_PORT_NAME
from tests.chart.chart_helpers import ALERTS_FILE, by_kind, one, render
from tests.prometheus.live_stack import router_monitor_job, shortened_rules


def pod_monitor(role: str) -> dict[str, Any]:
    """The chart's PodMonitor for ``role`` (engine or router)."""
    monitors = by_kind(render(sets={"monitoring.podMonitor.enabled": "true"}), "PodMonitor")
    return one(
        [m for m in monitors if m["metadata"]["labels"]["app.kubernetes.io/component"] == role],
        "PodMonitor",
    )


def test_scrape_job_relabels_like_the_charts_pod_monitor() -> None:
    monitor = pod_monitor("engine")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    chart_rules = [
        {"source_labels": rule["sourceLabels"], "target_label": rule["targetLabel"]}
        for rule in endpoint["relabelings"]
    ]
    assert chart_rules == list(CHART_RELABELINGS)
    name, namespace = monitor["metadata"]["name"], monitor["metadata"]["namespace"]
    job = pod_monitor_job(namespace, name, [EngineTarget("127.0.0.1:1", "ns", "p", "sp")], 1.0)
    assert job["job_name"] == f"podMonitor/{namespace}/{name}/0"
    assert job["relabel_configs"][-len(chart_rules) :] == chart_rules
    targets = {rule["target_label"] for rule in job["relabel_configs"]}
    assert {"namespace", "pod", "container", "job", "servingpolicy"} <= targets


def test_router_scrape_job_scrapes_like_the_charts_router_pod_monitor() -> None:
    monitor = pod_monitor("router")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == (ROUTER_METRICS_PORT_NAME, "/metrics")
    name, namespace = monitor["metadata"]["name"], monitor["metadata"]["namespace"]
    job = router_monitor_job(namespace, name, [EngineTarget("127.0.0.1:1", "ns", "p", "sp")], 1)
    assert job["job_name"] == f"podMonitor/{namespace}/{name}/0"
    chart_rules = [
        {"source_labels": rule["sourceLabels"], "target_label": rule["targetLabel"]}
        for rule in endpoint["relabelings"]
    ]
    assert job["relabel_configs"][-len(chart_rules) :] == chart_rules
    (static,) = job["static_configs"]
    assert static["labels"]["__meta_kubernetes_pod_container_name"] == ROUTER_CONTAINER
    replacements = {r["target_label"]: r.get("replacement") for r in job["relabel_configs"]}
    assert replacements["endpoint"] == ROUTER_METRICS_PORT_NAME


def test_rules_are_shortened_in_every_duration_and_nothing_else() -> None:
    groups = yaml.safe_load(ALERTS_FILE.read_text(encoding="utf-8"))["groups"]
    short = shortened_rules(groups, 60)["groups"]
    rules = {r["alert"]: r for g in short for r in g["rules"]}
    drop = rules["ArcServingPrefixCacheHitRateDrop"]
    assert drop["for"] == "15s"
    assert "[15s] offset 60s" in drop["expr"] and "15m" not in drop["expr"]
    assert "< 0.7 *" in drop["expr"]
    assert rules["ArcServingTTFTP99High"]["expr"].count("[5s]") == 1
    assert rules["ArcServingEngineDown"]["for"] == "5s"
    originals = {r["alert"]: r for g in groups for r in g["rules"]}
    for name, rule in rules.items():
        assert rule["labels"] == originals[name]["labels"]
        assert rule["annotations"] == originals[name]["annotations"]


def test_interval_variables_follow_grafanas_rules() -> None:
    # A 10-minute range at 900 points asks for 0.67 s: the 1 s scrape interval wins.
    short = Intervals.for_range(600, scrape_interval_s=1.0)
    assert (short.interval_s, short.rate_interval_s) == (1.0, 4.0)
    # A 6-hour range: 24 s steps; the rate window is 4 scrape intervals (60 s > 24 + 15 s).
    long = Intervals.for_range(6 * 3600, scrape_interval_s=15.0)
    assert (long.interval_s, long.rate_interval_s) == (24.0, 60.0)
    assert long.align(1000.0, 1100.0) == (984.0, 1080.0)
    # An annotation's step is its minimum interval.
    assert Intervals.for_range(600, 1.0, min_step_s=60).interval_s == 60


def test_variables_expand_as_grafanas_prometheus_data_source_does() -> None:
    assert variable_value(None) == ".*"
    assert variable_value(["pod-0"]) == "pod-0"
    assert variable_value(["a.b", "c"]) == "(a\\\\.b|c)"
    expr = 'rate(x{pod=~"$pod", namespace=~"${namespace}"}[$__rate_interval]) offset $__interval'
    intervals = Intervals.for_range(600, 1.0)
    assert expand(expr, intervals, {"pod": ["p"], "namespace": None}) == (
        'rate(x{pod=~"p", namespace=~".*"}[4s]) offset 1s'
    )
