"""The Grafana dashboards: stable uids, a ${datasource} variable, every query valid PromQL
(after substituting Grafana's variables) over metrics that vLLM and the plugin really export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from chart_helpers import CHART, known_metric_names

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# Grafana's interval variables become a duration; any other variable a matcher value.
INTERVAL_VARIABLE = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$", re.DOTALL)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def substitute(expr: str) -> str:
    """What Grafana sends Prometheus: variables replaced by sample values."""
    return VARIABLE.sub("x", INTERVAL_VARIABLE.sub("5m", expr))


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and variable query."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r}", target["expr"]))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["definition"])
            assert match, f"variable {variable['name']}: not a label_values() query"
            if match.group(1):
                found.append((f"variable {variable['name']!r}", match.group(1)))
    return found


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(substitute(expr)), visit)
    return names


def all_exprs() -> str:
    return "\n".join(expr for path in DASHBOARDS for _, expr in queries(load(path)))


def test_two_dashboards_with_unique_stable_uids() -> None:
    uids = [load(path)["uid"] for path in DASHBOARDS]
    assert uids == ["arc-serving-arc-internals", "arc-serving-overview"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_is_formatted_json(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text == json.dumps(json.loads(text), indent=2) + "\n"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_uses_the_datasource_variable(path: Path) -> None:
    dashboard = load(path)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_parses_and_uses_exported_metrics(path: Path) -> None:
    known = known_metric_names()
    found = queries(load(path))
    assert len(found) >= 8
    for where, expr in found:
        try:
            names = metric_names(expr)
        except ValueError as error:
            pytest.fail(f"{path.name} {where}: invalid PromQL: {error}\n{expr}")
        assert names, f"{path.name} {where}: no metric"
        unknown = names - known
        assert not unknown, f"{path.name} {where}: metrics nobody exports: {sorted(unknown)}"


def test_known_metrics_come_from_vllm_source() -> None:
    known = known_metric_names()
    for name in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    ):
        assert name in known
    # A misspelt name must be caught by the check above.
    assert "vllm:prefix_cache_hit_total" not in known


def test_hit_rate_is_a_rate_of_counters_not_a_lifetime_ratio() -> None:
    for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        uses = re.findall(rf"(\w*)\({re.escape(name)}\{{", all_exprs())
        assert uses and set(uses) == {"rate"}, uses


def test_hit_rate_and_ttft_per_policy_join_on_policy_info() -> None:
    exprs = all_exprs()
    joins = re.findall(
        r"group_left \(policy\) \(max by \(namespace, pod, policy\) "
        r"\(arc_evictor_policy_info\{[^}]*\}\) == 1\)",
        exprs,
    )
    # Hits, queries and TTFT buckets per policy (the state timelines use the series alone).
    assert len(joins) >= 3


def test_ttft_quantiles_come_from_the_histogram() -> None:
    exprs = all_exprs()
    for quantile in ("0.5", "0.9", "0.99"):
        assert (
            f"histogram_quantile({quantile}, sum by (le) "
            "(rate(vllm:time_to_first_token_seconds_bucket{" in exprs
        )


def test_arc_internals_show_every_list_and_p() -> None:
    dashboard = load(CHART / "dashboards" / "arc-internals.json")
    exprs = "\n".join(expr for _, expr in queries(dashboard))
    for metric in (
        "arc_evictor_target_recency_blocks",
        "arc_evictor_resident_blocks",
        "arc_evictor_ghost_blocks",
        "arc_evictor_ghost_hits_total",
        "arc_evictor_evictions_total",
        "arc_evictor_policy_switches_total",
    ):
        assert metric in exprs
    assert "by (pod, list)" in exprs


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_policy_switches_are_annotations(path: Path) -> None:
    annotations = [a for a in load(path)["annotations"]["list"] if "expr" in a]
    assert [a["name"] for a in annotations] == ["Policy switches"]
    assert "arc_evictor_policy_switches_total" in annotations[0]["expr"]
    assert annotations[0]["datasource"]["uid"] == "${datasource}"
