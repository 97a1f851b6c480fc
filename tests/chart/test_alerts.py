"""The alert rules: promtool checks and unit-tests files/alerts.yaml as it is and as the
PrometheusRule renders it; every metric they use is one vLLM, the plugin or the router exports.
"""

from __future__ import annotations

from pathlib import Path

import promql_parser
import yaml
from chart_helpers import (
    ALERTS_FILE,
    ROUTER_HISTOGRAMS,
    ROUTER_METRICS,
    ci_values,
    known_metric_names,
    one,
    render,
    router_registers,
    run,
    tool,
)

UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")


def alerts(groups: list[dict]) -> dict[str, dict]:
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def file_groups() -> list[dict]:
    return yaml.safe_load(ALERTS_FILE.read_text(encoding="utf-8"))["groups"]


def test_promtool_checks_the_rule_file() -> None:
    result = run([tool("promtool"), "check", "rules", ALERTS_FILE])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 10 rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run([tool("promtool"), "test", "rules", UNIT_TESTS])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_unit_tests() -> None:
    tested = {
        case["alertname"]
        for test in yaml.safe_load(UNIT_TESTS.read_text(encoding="utf-8"))["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert tested == set(alerts(file_groups()))


def test_alert_expressions_use_exported_metrics() -> None:
    known = known_metric_names()
    for name, rule in alerts(file_groups()).items():
        names: set[str] = set()

        def visit(node: promql_parser.Expr, names: set[str] = names) -> bool:
            if isinstance(node, promql_parser.VectorSelector) and node.name:
                names.add(node.name)
            return True

        promql_parser.walk(promql_parser.parse(rule["expr"]), visit)
        assert names and names <= known, f"{name}: {sorted(names - known)}"


def test_rendered_prometheusrule_passes_promtool_and_applies_values(tmp_path: Path) -> None:
    rule = one(render(ci_values("monitoring-values.yaml")), "PrometheusRule")
    groups = rule["spec"]["groups"]
    rendered = alerts(groups)
    expected = alerts(file_groups())
    assert "ArcServingTTFTP99High" not in rendered
    assert "ArcServingTTFTP99VeryHigh" in rendered
    for name, source in expected.items():
        if name == "ArcServingTTFTP99High":
            continue
        assert rendered[name]["expr"] == source["expr"]
        assert rendered[name]["labels"] == {**source["labels"], "team": "ml-platform"}
        assert rendered[name]["annotations"] == source["annotations"]
    rule_file = tmp_path / "rendered.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    result = run([tool("promtool"), "check", "rules", rule_file])
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_prometheusrule_is_the_file_unchanged() -> None:
    rule = one(render(sets={"prometheusRule.enabled": "true"}), "PrometheusRule")
    assert rule["spec"]["groups"] == file_groups()


def test_router_metrics_are_the_installed_routers() -> None:
    counters_and_gauges = {
        n for n in ROUTER_METRICS if not n.endswith(("_sum", "_count", "_bucket"))
    }
    for family in sorted(ROUTER_HISTOGRAMS | counters_and_gauges):
        assert router_registers(family), family
    # A misspelt family is not found.
    assert not router_registers("vllm_router_prefix_routing_decision_total")


def test_engine_and_router_down_alerts_split_the_targets() -> None:
    rules = alerts(file_groups())
    assert 'container!="router"' in rules["ArcServingEngineDown"]["expr"]
    assert 'container="router"' in rules["ArcServingRouterDown"]["expr"]
