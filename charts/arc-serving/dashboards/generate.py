"""The chart's Grafana dashboards as code, built with Grafana's Python SDK (grafana-foundation-sdk).

``python charts/arc-serving/dashboards/generate.py`` (``make dashboards``) writes
``overview.json``, ``arc-internals.json`` and ``routing.json`` next to this file; the chart
ships those files (templates/dashboards-configmap.yaml) but not this generator (.helmignore),
and tests/chart/test_dashboards.py fails when they differ from what it builds. It needs only
grafana-foundation-sdk (the root pyproject's ``dev`` group).

Every query selects the engines by the dashboard variables ``$namespace``, ``$servingpolicy`` and
``$pod`` (the routers by the first two) and reads through the ``$datasource`` variable. The
SDK's models lack a few fields Grafana reads (a variable's ``definition``, the built-in
annotation's flag, the Prometheus annotation's step and title/text templates); ``_WithFields``
adds them to the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

HERE = Path(__file__).resolve().parent
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
ENGINES = 'namespace=~"$namespace", servingpolicy=~"$servingpolicy", pod=~"$pod"'
# The routers of the selected ServingPolicies (their pods are not among the $pod options, which
# list engines).
ROUTERS = 'namespace=~"$namespace", servingpolicy=~"$servingpolicy"'
# The policy each pod runs now: one series per (namespace, pod) with value 1.
ACTIVE_POLICY = f"(max by (namespace, pod, policy) (arc_evictor_policy_info{{{ENGINES}}}) == 1)"
T1_MATCHER = ', list="t1"'
TAGS = ["arc-serving", "vllm"]
PANEL_HEIGHT, HALF_WIDTH, FULL_WIDTH = 8, 12, 24

Model = TypeVar("Model")


class _WithFields(Generic[Model]):
    """A builder whose model's JSON carries ``fields`` that the SDK's model has no slot for."""

    def __init__(self, builder: Any, fields: dict[str, object]) -> None:
        self.builder = builder
        self.fields = fields

    def build(self) -> Model:
        model = self.builder.build()
        sdk_json: Callable[[], dict[str, object]] = model.to_json
        model.to_json = lambda: sdk_json() | self.fields
        return model


def engines(metric: str, extra_matchers: str = "") -> str:
    """``metric`` restricted to the engines the dashboard variables select."""
    return f"{metric}{{{ENGINES}{extra_matchers}}}"


def rate(metric: str) -> str:
    return f"rate({engines(metric)}[$__rate_interval])"


def routers(metric: str) -> str:
    """``metric`` restricted to the routers of the ServingPolicies the variables select."""
    return f"{metric}{{{ROUTERS}}}"


def router_rate(metric: str) -> str:
    return f"rate({routers(metric)}[$__rate_interval])"


def ratio_per_pod(hits: str, queries: str) -> str:
    """Hits over queries per pod, each a rate of counters over the rate window."""
    return f"sum by (namespace, pod) ({rate(hits)})\n/\nsum by (namespace, pod) ({rate(queries)})"


def per_active_policy(per_pod: str) -> str:
    """A per-(namespace, pod) vector labelled with each pod's active policy."""
    return f"{per_pod} * on (namespace, pod) group_left (policy) {ACTIVE_POLICY}"


def quantile(q: str, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate(histogram)}))"


def query(ref_id: str, expr: str, legend: str) -> prometheus.Dataquery:
    return (
        prometheus.Dataquery()
        .datasource(DATASOURCE)
        .ref_id(ref_id)
        .expr(expr)
        .legend_format(legend)
        .range()
        .editor_mode(prometheus_models.QueryEditorMode.CODE)
    )


def legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def graph(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[prometheus.Dataquery],
    *,
    fraction: bool = False,
    stacked: bool = False,
    bars: bool = False,
) -> timeseries.Panel:
    """A time-series panel; ``fraction`` bounds the axis to [0, 1]."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .height(PANEL_HEIGHT)
        .span(HALF_WIDTH)
        .unit(unit)
        .draw_style(common.GraphDrawStyle.BARS if bars else common.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(80 if bars else 40 if stacked else 10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(legend())
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if not bars:
        panel = panel.span_nulls(False)
    if stacked:
        panel = panel.stacking(
            common_builders.StackingConfig().mode(common.StackingMode.NORMAL).group("A")
        )
    if fraction:
        panel = panel.min(0).max(1)
    for target in queries:
        panel = panel.with_target(target)
    return panel


def active_policy_timeline(height: int, width: int) -> statetimeline.Panel:
    """The eviction policy each pod runs, as a state timeline."""
    return (
        statetimeline.Panel()
        .title("Active policy per pod")
        .description("The eviction policy each engine runs now (arc_evictor_policy_info).")
        .datasource(DATASOURCE)
        .height(height)
        .span(width)
        .unit("short")
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .row_height(0.8)
        .align_value("left")
        .legend(legend())
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.SINGLE)
            .sort(common.SortOrder.NONE)
        )
        .with_target(query("A", ACTIVE_POLICY, "{{namespace}}/{{pod}}: {{policy}}"))
    )


def engine_variable(name: str, label: str, selector: str) -> _WithFields[Any]:
    """A multi-value query variable over the engines' series, defaulting to All."""
    series = f"vllm:num_requests_running{{{selector}}}" if selector else "vllm:num_requests_running"
    definition = f"label_values({series}, {name})"
    variable = (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(
            {
                "query": definition,
                "refId": "PrometheusVariableQueryEditor-VariableQuery",
                "qryType": 1,
            }
        )
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
        .current(dashboard_models.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
        .regex("")
    )
    return _WithFields(variable, {"definition": definition})


def skeleton(uid: str, title: str, description: str) -> dashboard_builders.Dashboard:
    """What both dashboards share: variables, the policy-switch annotations, links, time."""
    switches = engines("arc_evictor_policy_switches_total")
    built_in = _WithFields(
        dashboard_builders.AnnotationQuery()
        .name("Annotations & Alerts")
        .datasource(dashboard_models.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .enable(True)
        .hide(True)
        .icon_color("rgba(0, 211, 255, 1)")
        .type("dashboard"),
        {"builtIn": 1},
    )
    switch_marks = _WithFields(
        dashboard_builders.AnnotationQuery()
        .name("Policy switches")
        .datasource(DATASOURCE)
        .enable(True)
        .hide(False)
        .icon_color("orange")
        # The counter's rise since the previous step ($__interval is the step): summed over
        # the steps it telescopes, so each switch marks exactly one step, the first at or
        # after the first scrape that saw it. A switch in the step of a counter reset (a
        # negative difference) or in a pod's first step (no sample a step before) has none.
        .expr(f"sum by (namespace, pod) ({switches} - {switches} offset $__interval) > 0"),
        # The Prometheus data source's annotation fields (the SDK's model has none of them).
        {
            # The Min step: the chart's scrape interval (monitoring.podMonitor.interval), so
            # marks fall on the steps of the panels at that scrape interval, where the
            # "Active policy per pod" timeline changes. Grafana takes a query's Min step in
            # place of the data source's scrape interval: a smaller one would put marks up to
            # a scrape interval before the timeline's change.
            "step": "15s",
            "titleFormat": "Policy switch",
            "textFormat": "{{namespace}}/{{pod}} switched eviction policy",
            "tagKeys": "namespace,pod",
            "useValueForTime": False,
        },
    )
    return (
        dashboard_builders.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("")
        .version(1)
        .link(
            dashboard_builders.DashboardLink("arc-serving dashboards")
            .type(dashboard_models.DashboardLinkType.DASHBOARDS)
            .tags(["arc-serving"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(
            dashboard_builders.DatasourceVariable("datasource")
            .label("Data source")
            .type("prometheus")
        )
        .with_variable(engine_variable("namespace", "Namespace", ""))
        .with_variable(engine_variable("servingpolicy", "ServingPolicy", 'namespace=~"$namespace"'))
        .with_variable(
            engine_variable(
                "pod", "Pod", 'namespace=~"$namespace", servingpolicy=~"$servingpolicy"'
            )
        )
        .annotation(built_in)
        .annotation(switch_marks)
    )


def overview() -> dashboard_builders.Dashboard:
    """The main dashboard: hit rates per pod and per policy, latency quantiles, load."""
    hit_rate = ratio_per_pod("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    hits_per_policy, queries_per_policy = (
        "sum by (policy) (" + per_active_policy(f"sum by (namespace, pod) ({rate(metric)})") + ")"
        for metric in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    )
    ttft = "vllm:time_to_first_token_seconds_bucket"
    ttft_per_policy = per_active_policy(f"sum by (namespace, pod, le) ({rate(ttft)})")
    return (
        skeleton(
            "arc-serving-overview",
            "arc-serving / Prefix cache and latency",
            "Prefix-cache hit rate per pod and per eviction policy, time to first token, "
            "KV-cache usage and queueing of arc-serving vLLM engines.",
        )
        .with_row(dashboard_builders.Row("Prefix cache").id(1))
        .with_panel(
            graph(
                "Prefix-cache hit rate per policy",
                "Cached prompt tokens / queried prompt tokens over the rate window (vLLM's "
                "prefix-cache counters), grouped by the policy each pod reports in "
                "arc_evictor_policy_info.",
                "percentunit",
                [query("A", f"{hits_per_policy}\n/\n{queries_per_policy}", "{{policy}}")],
                fraction=True,
            ).id(2)
        )
        .with_panel(
            graph(
                "Prefix-cache hit rate per pod",
                "Cached / queried prompt tokens per pod over the rate window (not the lifetime "
                "ratio).",
                "percentunit",
                [query("A", hit_rate, "{{namespace}}/{{pod}}")],
                fraction=True,
            ).id(3)
        )
        .with_panel(
            graph(
                "Block hit rate per pod (plugin)",
                "Blocks found resident / blocks looked up, as counted by the arc-evictor plugin.",
                "percentunit",
                [
                    query(
                        "A",
                        ratio_per_pod(
                            "arc_evictor_block_hits_total", "arc_evictor_block_queries_total"
                        ),
                        "{{namespace}}/{{pod}}",
                    )
                ],
                fraction=True,
            ).id(4)
        )
        .with_panel(active_policy_timeline(PANEL_HEIGHT, HALF_WIDTH).id(5))
        .with_row(dashboard_builders.Row("Latency").id(6))
        .with_panel(
            graph(
                "Time to first token",
                "p50, p90 and p99 of vLLM's time-to-first-token histogram over the selected pods.",
                "s",
                [
                    query(ref, quantile(q, ttft), f"p{label}")
                    for ref, q, label in (("A", "0.5", 50), ("B", "0.9", 90), ("C", "0.99", 99))
                ],
            ).id(7)
        )
        .with_panel(
            graph(
                "Time-to-first-token p99 per policy",
                "p99 of the time-to-first-token histogram, buckets grouped by each pod's active "
                "policy.",
                "s",
                [
                    query(
                        "A",
                        f"histogram_quantile(0.99, sum by (le, policy) ({ttft_per_policy}))",
                        "{{policy}}",
                    )
                ],
            ).id(8)
        )
        .with_panel(
            graph(
                "Inter-token latency",
                "p50 and p99 of vLLM's inter-token latency histogram.",
                "s",
                [
                    query(ref, quantile(q, "vllm:inter_token_latency_seconds_bucket"), legend)
                    for ref, q, legend in (("A", "0.5", "p50"), ("B", "0.99", "p99"))
                ],
            ).id(9)
        )
        .with_panel(
            graph(
                "End-to-end request latency",
                "p50 and p99 of vLLM's end-to-end request latency histogram.",
                "s",
                [
                    query(ref, quantile(q, "vllm:e2e_request_latency_seconds_bucket"), legend)
                    for ref, q, legend in (("A", "0.5", "p50"), ("B", "0.99", "p99"))
                ],
            ).id(10)
        )
        .with_row(dashboard_builders.Row("Load").id(11))
        .with_panel(
            graph(
                "KV-cache usage per pod",
                "Fraction of KV blocks held by running requests (vllm:kv_cache_usage_perc).",
                "percentunit",
                [
                    query(
                        "A",
                        f"max by (namespace, pod) ({engines('vllm:kv_cache_usage_perc')})",
                        "{{namespace}}/{{pod}}",
                    )
                ],
                fraction=True,
            ).id(12)
        )
        .with_panel(
            graph(
                "Running and waiting requests per pod",
                "Requests in the running batch and in the waiting queue.",
                "short",
                [
                    query(
                        ref,
                        f"sum by (namespace, pod) ({engines(f'vllm:num_requests_{state}')})",
                        f"{state} {{{{namespace}}}}/{{{{pod}}}}",
                    )
                    for ref, state in (("A", "running"), ("B", "waiting"))
                ],
            ).id(13)
        )
    )


def arc_internals() -> dashboard_builders.Dashboard:
    """The policy's own state: ARC's p, list and ghost sizes, ghost hits, evictions, switches."""

    def per_list(expr: str) -> prometheus.Dataquery:
        return query("A", f"sum by (pod, list) ({expr})", "{{pod}} {{list}}")

    return (
        skeleton(
            "arc-serving-arc-internals",
            "arc-serving / ARC internals",
            "State of the arc-evictor policy in each engine: ARC's target p, T1/T2 and B1/B2 "
            "sizes, ghost hits, evictions per list and policy switches.",
        )
        .with_row(dashboard_builders.Row("ARC state").id(1))
        .with_panel(
            graph(
                "Target recency size p and |T1|",
                "ARC's target size p for T1 (arc_evictor_target_recency_blocks) against T1's "
                "actual size: ghost hits in B1 raise p, in B2 lower it.",
                "short",
                [
                    query(
                        "A",
                        f"max by (namespace, pod) ({engines('arc_evictor_target_recency_blocks')})",
                        "p {{namespace}}/{{pod}}",
                    ),
                    query(
                        "B",
                        "max by (namespace, pod) "
                        f"({engines('arc_evictor_resident_blocks', T1_MATCHER)})",
                        "|T1| {{namespace}}/{{pod}}",
                    ),
                ],
            ).id(2)
        )
        .with_panel(
            graph(
                "Resident blocks per list",
                "Cached blocks per policy list: t1 (seen once recently) and t2 (seen twice or "
                "more) for ARC and DBL, lru for LRU.",
                "short",
                [per_list(engines("arc_evictor_resident_blocks"))],
                stacked=True,
            ).id(3)
        )
        .with_panel(
            graph(
                "Ghost blocks per list",
                "Keys remembered after eviction: b1 (evicted from t1) and b2 (evicted from t2).",
                "short",
                [per_list(engines("arc_evictor_ghost_blocks"))],
                stacked=True,
            ).id(4)
        )
        .with_panel(
            graph(
                "Ghost hits per second",
                "Requests for a key still in a ghost list; each one moves p.",
                "ops",
                [per_list(rate("arc_evictor_ghost_hits_total"))],
            ).id(5)
        )
        .with_row(dashboard_builders.Row("Evictions and switches").id(6))
        .with_panel(
            graph(
                "Evictions per second per list",
                "Blocks evicted from each list.",
                "ops",
                [per_list(rate("arc_evictor_evictions_total"))],
                stacked=True,
            ).id(7)
        )
        .with_panel(
            graph(
                "Policy switches",
                "Live policy switches per pod in each interval (also shown as annotations).",
                "short",
                [
                    query(
                        "A",
                        "sum by (namespace, pod) (increase("
                        f"{engines('arc_evictor_policy_switches_total')}[$__rate_interval]))",
                        "{{namespace}}/{{pod}}",
                    )
                ],
                bars=True,
            ).id(8)
        )
        .with_panel(active_policy_timeline(6, FULL_WIDTH).id(9))
    )


def routing() -> dashboard_builders.Dashboard:
    """The router in front of the replicas (vllm-router's metrics, docs/chart.md, "Routing")
    and how evenly load and cache hits spread over the replicas."""
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    per_servingpolicy = (
        f"sum by (namespace, servingpolicy) ({rate(hits)})\n/\n"
        f"sum by (namespace, servingpolicy) ({rate(queries)})"
    )
    latency = "vllm_router_generate_duration_seconds_bucket"
    return (
        skeleton(
            "arc-serving-routing",
            "arc-serving / Routing",
            "The vLLM router in front of each ServingPolicy's replicas: requests and prefix-cache "
            "hit rate per replica, routing decisions by outcome, KV placement lookups, router "
            "latency and the workers' health as the router sees it.",
        )
        .with_row(dashboard_builders.Row("Replicas").id(1))
        .with_panel(
            graph(
                "Requests per replica",
                "Requests each serving pod finished per second (vllm:request_success_total): how "
                "evenly the router spreads the load.",
                "reqps",
                [
                    query(
                        "A",
                        f"sum by (namespace, pod) ({rate('vllm:request_success_total')})",
                        "{{namespace}}/{{pod}}",
                    )
                ],
            ).id(2)
        )
        .with_panel(
            graph(
                "Prefix-cache hit rate per replica",
                "Cached / queried prompt tokens per pod, and over all pods of each ServingPolicy. "
                "A replica under half of its ServingPolicy's rate for 15 minutes raises "
                "ArcServingReplicaHitRateLow.",
                "percentunit",
                [
                    query("A", ratio_per_pod(hits, queries), "{{namespace}}/{{pod}}"),
                    query("B", per_servingpolicy, "{{namespace}}/{{servingpolicy}} (all replicas)"),
                ],
                fraction=True,
            ).id(3)
        )
        .with_row(dashboard_builders.Row("Router").id(4))
        .with_panel(
            graph(
                "Routing decisions by outcome",
                "The router's prefix routing decisions per second "
                "(vllm_router_prefix_routing_decisions_total): kv_aware's prefix_cost (cheapest "
                "cached prefix and load) and cache_aware's prefix_hit and prefix_miss use the "
                "prompt's prefix; load_imbalance and missing_tokens pick a worker by load alone "
                "(ArcServingRoutingFallback).",
                "ops",
                [
                    query(
                        "A",
                        "sum by (namespace, servingpolicy, policy, outcome) "
                        f"({router_rate('vllm_router_prefix_routing_decisions_total')})",
                        "{{servingpolicy}} {{policy}}: {{outcome}}",
                    )
                ],
                stacked=True,
            ).id(5)
        )
        .with_panel(
            graph(
                "KV placement lookups",
                "kv_aware's lookups of the prompt's blocks in the index built from the replicas' "
                "KV events (vllm_router_kv_placement_lookups_total): hit (a replica holds a "
                "prefix), miss, missing_tokens (no tokens to look up).",
                "ops",
                [
                    query(
                        "A",
                        "sum by (namespace, servingpolicy, result) "
                        f"({router_rate('vllm_router_kv_placement_lookups_total')})",
                        "{{servingpolicy}}: {{result}}",
                    )
                ],
                stacked=True,
            ).id(6)
        )
        .with_panel(
            graph(
                "Router latency",
                "p50, p90 and p99 of the time the router takes for a generate request, its "
                "worker's answer included (vllm_router_generate_duration_seconds).",
                "s",
                [
                    query(
                        ref,
                        f"histogram_quantile({q}, sum by (le) ({router_rate(latency)}))",
                        f"p{label}",
                    )
                    for ref, q, label in (("A", "0.5", 50), ("B", "0.9", 90), ("C", "0.99", 99))
                ],
            ).id(7)
        )
        .with_panel(
            graph(
                "Worker health per router",
                "1 while the router's health checks of a replica pass, 0 when it sends it nothing "
                "(vllm_router_worker_health; ArcServingRouterWorkerUnhealthy).",
                "short",
                [
                    query(
                        "A",
                        "min by (namespace, servingpolicy, worker) "
                        f"({routers('vllm_router_worker_health')})",
                        "{{servingpolicy}} {{worker}}",
                    )
                ],
            ).id(8)
        )
    )


# File name under charts/arc-serving/dashboards/ -> the dashboard's builder.
DASHBOARDS: dict[str, Callable[[], dashboard_builders.Dashboard]] = {
    "overview.json": overview,
    "arc-internals.json": arc_internals,
    "routing.json": routing,
}


def render(name: str) -> str:
    """The JSON file the chart ships for dashboard ``name`` (a key of DASHBOARDS)."""
    built = json.loads(json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder))
    return json.dumps(built, indent=2) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python charts/arc-serving/dashboards/generate.py",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "folder",
        type=Path,
        nargs="?",
        default=HERE,
        help="where to write the dashboards' JSON files (default: next to this file)",
    )
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    for name in DASHBOARDS:
        (args.folder / name).write_text(render(name), encoding="utf-8")
        print(args.folder / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
