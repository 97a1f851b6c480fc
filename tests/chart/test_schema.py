"""values.schema.json rejects bad values (helm 4 enforces it on install, upgrade and template),
the templates reject what a schema cannot express, and values.yaml documents every value.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import yaml
from chart_helpers import CHART, CRD_FILE, helm_template

from arc_serving_common.names import POLICY_NAMES

SCHEMA = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
VALUES_TEXT = (CHART / "values.yaml").read_text(encoding="utf-8")
TRACE = "loadtest.trace"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        pytest.param(
            {"servingPolicy.policy": "FIFO"}, "/servingPolicy/policy", id="unknown-policy"
        ),
        pytest.param(
            {"servingPolicy.policy": "arc"}, "/servingPolicy/policy", id="lower-case-policy"
        ),
        pytest.param(
            {"servingPolicy.replicas": "-1"}, "/servingPolicy/replicas", id="negative-replicas"
        ),
        pytest.param(
            {"servingPolicy.replicas": "2147483648"},
            "/servingPolicy/replicas",
            id="replicas-beyond-int32",
        ),
        # helm drops a section set to null; "required" turns that into a schema error
        # instead of a nil pointer in a template.
        pytest.param({"dashboards": "null"}, "missing property 'dashboards'", id="null-section"),
        pytest.param(
            {"servingPolicy.switchMode": "Live"}, "/servingPolicy/switchMode", id="switch-mode"
        ),
        pytest.param(
            {"servingPolicy.cache.numBlocks": "4096"},
            "/servingPolicy/cache': 'oneOf' failed",
            id="both-cache-sizes",
        ),
        pytest.param(
            {"servingPolicy.cache.gpuMemoryUtilization": "null"},
            "/servingPolicy/cache': 'oneOf' failed",
            id="no-cache-size",
        ),
        pytest.param(
            {"servingPolicy.cache.gpuMemoryUtilization": "1.5"},
            "/servingPolicy/cache/gpuMemoryUtilization",
            id="utilization-above-one",
        ),
        pytest.param(
            {"servingPolicy.cache.blockSize": "24"},
            "/servingPolicy/cache/blockSize",
            id="block-size-not-multiple-of-16",
        ),
        pytest.param(
            {"servingPolicy.name": "Bad_Name"}, "/servingPolicy/name", id="servingpolicy-name"
        ),
        pytest.param({"replicas": "2"}, "additional properties 'replicas'", id="unknown-key"),
        pytest.param(
            {"operator.metricsPort": "9000"},
            "additional properties 'metricsPort'",
            id="removed-metrics-port",
        ),
        pytest.param({"cleanup.timeout": "soon"}, "/cleanup/timeout", id="cleanup-timeout"),
        pytest.param({"operator.logLevel": "loud"}, "/operator/logLevel", id="operator-log-level"),
        pytest.param(
            {"ingress.enabled": "true", "ingress.tls.enabled": "true"},
            "/ingress",
            id="tls-without-host",
        ),
        pytest.param({"ingress.pathType": "Regex"}, "/ingress/pathType", id="ingress-path-type"),
        pytest.param(
            {"monitoring.podMonitor.interval": "often"},
            "/monitoring/podMonitor/interval",
            id="scrape-interval",
        ),
        pytest.param(
            {"loadtest.enabled": "true"}, f"/{TRACE.replace('.', '/')}", id="load-test-no-trace"
        ),
        pytest.param(
            {
                "loadtest.enabled": "true",
                f"{TRACE}.inline": "{}",
                f"{TRACE}.existingConfigMap": "t",
            },
            f"/{TRACE.replace('.', '/')}",
            id="load-test-two-traces",
        ),
        pytest.param({"loadtest.workers": "0"}, "/loadtest/workers", id="load-test-no-workers"),
        pytest.param(
            {f"{TRACE}.format": "csv"}, f"/{TRACE.replace('.', '/')}/format", id="trace-format"
        ),
        pytest.param({"loadtest.runTime": "ten minutes"}, "/loadtest/runTime", id="run-time"),
        pytest.param(
            {"operator.image.digest": "sha256:abc"}, "/operator/image/digest", id="digest"
        ),
        pytest.param(
            {"servingPolicy.routing.policy": "least_loaded"},
            "at '/servingPolicy/routing/policy': value must be one of '', 'none', 'round_robin'",
            id="unknown-routing-policy",
        ),
        pytest.param(
            {"servingPolicy.routing.policy": "KV_AWARE"},
            "/servingPolicy/routing/policy",
            id="upper-case-routing-policy",
        ),
        pytest.param(
            {"servingPolicy.routing.replicas": "0"},
            "at '/servingPolicy/routing/replicas': minimum: got 0, want 1",
            id="no-router-pods",
        ),
        pytest.param(
            {"servingPolicy.routing.resources.memory": "a lot"},
            "/servingPolicy/routing/resources/memory",
            id="router-memory-quantity",
        ),
        pytest.param(
            {"servingPolicy.routing.image": "r:1"},
            "additional properties 'image'",
            id="router-image-in-servingpolicy-values",
        ),
        pytest.param(
            {"servingPolicy.routing.args": "--policy=random"},
            "/servingPolicy/routing/args",
            id="router-args-not-a-list",
        ),
        pytest.param(
            {"router.image.pullPolicy": "Always"},
            "additional properties 'pullPolicy'",
            id="router-pull-policy",
        ),
        pytest.param({"router.image.repository": ""}, "/router/image/repository", id="router-repo"),
        pytest.param(
            {
                "servingPolicy.model.volume.persistentVolumeClaim.claimName": "models",
                "servingPolicy.model.volume.hostPath.path": "/srv/models",
            },
            "/servingPolicy/model/volume",
            id="model-volume-with-two-sources",
        ),
        pytest.param(
            {"servingPolicy.model.volume.persistentVolumeClaim.claimName": "models"},
            "/servingPolicy/model/name",
            id="model-volume-with-a-hub-id",
        ),
        pytest.param(
            {
                "servingPolicy.model.name": "/models/../etc",
                "servingPolicy.model.volume.hostPath.path": "/srv/models",
            },
            "/servingPolicy/model/name",
            id="model-path-leaving-the-volume",
        ),
        pytest.param(
            {
                "servingPolicy.model.name": "/models/q",
                "servingPolicy.model.volume.hostPath.path": "srv/models",
            },
            "/servingPolicy/model/volume/hostPath/path",
            id="relative-host-path",
        ),
        pytest.param(
            {
                "servingPolicy.model.name": "/models/q",
                "servingPolicy.model.volume.nfs.server": "nfs",
            },
            "/servingPolicy/model/volume",
            id="unsupported-model-volume",
        ),
        pytest.param(
            {
                "loadtest.tokenizer.path": "/srv/tiny",
                "loadtest.tokenizer.volume.hostPath.path": "/srv/models",
            },
            "/loadtest/tokenizer/path",
            id="tokenizer-path-outside-its-volume",
        ),
        pytest.param(
            {
                "loadtest.tokenizer.path": "/models/tiny",
                "loadtest.tokenizer.volume.hostPath.path": "/srv/models",
                "loadtest.tokenizer.volume.persistentVolumeClaim.claimName": "models",
            },
            "/loadtest/tokenizer/volume",
            id="tokenizer-volume-with-two-sources",
        ),
        pytest.param(
            {"servingPolicy.nodeSelector.gpu type": "a100"},
            "at '/servingPolicy/nodeSelector': additional properties 'gpu type' not allowed",
            id="node-selector-key-not-a-label-key",
        ),
        pytest.param(
            {"servingPolicy.nodeSelector.gpu": "true"},
            "at '/servingPolicy/nodeSelector/gpu': got boolean, want string",
            id="node-selector-value-set-as-a-boolean",
        ),
        pytest.param(
            {"servingPolicy.routing.nodeSelector.pool": "cpu pool"},
            "at '/servingPolicy/routing/nodeSelector/pool': 'cpu pool' does not match pattern",
            id="node-selector-value-not-a-label-value",
        ),
        pytest.param(
            {f"servingPolicy.nodeSelector.{'p' * 254}/gpu": "a100"},
            "false schema",
            id="node-selector-key-prefix-too-long",
        ),
        pytest.param(
            {"servingPolicy.tolerations[0].value": "present"},
            "at '/servingPolicy/tolerations/0': missing property 'operator'",
            id="keyless-toleration-not-exists",
        ),
        pytest.param(
            {
                "servingPolicy.tolerations[0].key": "nvidia.com/gpu",
                "servingPolicy.tolerations[0].operator": "Exists",
                "servingPolicy.tolerations[0].value": "present",
            },
            "at '/servingPolicy/tolerations/0/value': maxLength: got 7, want 0",
            id="exists-toleration-with-a-value",
        ),
        pytest.param(
            {
                "servingPolicy.routing.tolerations[0].key": "spot",
                "servingPolicy.routing.tolerations[0].effect": "NoSchedule",
                "servingPolicy.routing.tolerations[0].tolerationSeconds": "30",
            },
            "at '/servingPolicy/routing/tolerations/0/effect': value must be 'NoExecute'",
            id="toleration-seconds-without-no-execute",
        ),
        pytest.param(
            {"servingPolicy.tolerations[0].key": "gpu", "servingPolicy.tolerations[0].effect": "X"},
            "at '/servingPolicy/tolerations/0/effect': value must be one of '', 'NoSchedule'",
            id="unknown-taint-effect",
        ),
        pytest.param(
            {
                "servingPolicy.tolerations[0].key": "gpu",
                "servingPolicy.tolerations[0].operator": "Gt",
                "servingPolicy.tolerations[0].value": "3",
            },
            "at '/servingPolicy/tolerations/0/operator': value must be one of '', 'Equal'",
            id="comparison-toleration-operator",
        ),
        pytest.param(
            {"servingPolicy.tolerations[0].key": "gpu type"},
            "at '/servingPolicy/tolerations/0/key'",
            id="toleration-key-not-a-label-key",
        ),
        pytest.param(
            {"servingPolicy.tolerations[0].key": "gpu", "servingPolicy.tolerations[0].taint": "x"},
            "at '/servingPolicy/tolerations/0': additional properties 'taint' not allowed",
            id="unknown-toleration-field",
        ),
        pytest.param(
            {"servingPolicy.disruption.maxUnavailable": "0"},
            "at '/servingPolicy/disruption/maxUnavailable': minimum: got 0, want 1",
            id="budget-that-blocks-every-drain",
        ),
        pytest.param(
            {"servingPolicy.disruption.drainDelaySeconds": "-1"},
            "at '/servingPolicy/disruption/drainDelaySeconds'",
            id="negative-drain-delay",
        ),
        pytest.param(
            {"servingPolicy.disruption.requestSeconds": "86401"},
            "at '/servingPolicy/disruption/requestSeconds'",
            id="request-longer-than-a-day",
        ),
        pytest.param(
            {"servingPolicy.disruption.maxUnavailable": "25%"},
            "at '/servingPolicy/disruption/maxUnavailable'",
            id="budget-percentage",
        ),
        pytest.param(
            {"servingPolicy.disruption.grace": "10"},
            "at '/servingPolicy/disruption': additional properties 'grace' not allowed",
            id="unknown-disruption-field",
        ),
        pytest.param(
            {"httpRoute.enabled": "true"},
            "at '/httpRoute/parentRefs': minItems: got 0, want 1",
            id="httproute-without-a-gateway",
        ),
        pytest.param(
            {"httpRoute.parentRefs[0].name": "gw", "httpRoute.parentRefs[0].kind": "Service"},
            "at '/httpRoute/parentRefs/0': additional properties 'kind' not allowed",
            id="httproute-parent-of-another-kind",
        ),
        pytest.param(
            {"httpRoute.parentRefs[0].name": "gw", "httpRoute.parentRefs[0].namespace": "Gw_Ns"},
            "at '/httpRoute/parentRefs/0/namespace'",
            id="httproute-parent-namespace",
        ),
        pytest.param(
            {"httpRoute.hostnames[0]": "LLM.example.com"},
            "at '/httpRoute/hostnames/0'",
            id="httproute-hostname",
        ),
        pytest.param({"httpRoute.paths[0]": "v1"}, "at '/httpRoute/paths/0'", id="relative-path"),
        # What the HTTPRoute CRD's CEL rules refuse in a path.
        pytest.param({"httpRoute.paths[0]": "/v1//x"}, "at '/httpRoute/paths/0'", id="path-//"),
        pytest.param({"httpRoute.paths[0]": "/v1/.."}, "at '/httpRoute/paths/0'", id="path-.."),
        pytest.param({"httpRoute.paths[0]": "/v1%2Fx"}, "at '/httpRoute/paths/0'", id="path-%2F"),
        pytest.param(
            {"httpRoute.pathType": "RegularExpression"},
            "at '/httpRoute/pathType': value must be one of 'PathPrefix', 'Exact'",
            id="httproute-path-type",
        ),
        pytest.param(
            {"httpRoute.timeouts.request": "forever"},
            "at '/httpRoute/timeouts/request'",
            id="httproute-timeout",
        ),
    ],
)
def test_schema_rejects_bad_values(sets: dict[str, str], message: str) -> None:
    result = helm_template(sets=sets)
    assert result.returncode != 0, f"accepted {sets}"
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr
    assert not result.stdout.strip(), "nothing is rendered for rejected values"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        pytest.param(
            {
                "servingPolicy.cache.numBlocks": "100",
                "servingPolicy.cache.gpuMemoryUtilization": "0",
            },
            "numBlocks * blockSize = 1600 tokens cannot hold one request of maxModelLen = 8192",
            id="cache-smaller-than-one-request",
        ),
        pytest.param(
            {"prometheusRule.enabled": "true", "prometheusRule.disabledAlerts[0]": "Nope"},
            'prometheusRule.disabledAlerts: unknown alert "Nope"; the chart\'s alerts are: '
            "ArcServingPrefixCacheHitRateDrop",
            id="unknown-alert",
        ),
        pytest.param(
            {"operator.watchNamespaces": "{team-a,team-b}"},
            "operator.watchNamespaces (team-a, team-b) does not include the release namespace "
            '"llm", where the chart creates the default ServingPolicy',
            id="default-policy-outside-watched-namespaces",
        ),
        pytest.param(
            {"servingPolicy.enabled": "false", "ingress.enabled": "true"},
            "servingPolicy.enabled is false, so the chart creates no ServingPolicy and no Service",
            id="ingress-without-service",
        ),
        pytest.param(
            {
                "servingPolicy.enabled": "false",
                "loadtest.enabled": "true",
                f"{TRACE}.existingConfigMap": "t",
            },
            "set ingress.serviceName to an existing ServingPolicy's Service",
            id="load-test-without-service",
        ),
        pytest.param(
            {
                "servingPolicy.enabled": "false",
                "httpRoute.enabled": "true",
                "httpRoute.parentRefs[0].name": "gw",
            },
            "no Service for the HTTPRoute to send requests to; set httpRoute.serviceName",
            id="httproute-without-service",
        ),
        pytest.param(
            {
                "monitoring.podMonitor.enabled": "true",
                "monitoring.serviceMonitor.enabled": "true",
            },
            "monitoring: enable either podMonitor or serviceMonitor, not both",
            id="both-monitors",
        ),
    ],
)
def test_templates_reject_what_the_schema_cannot_express(
    sets: dict[str, str], message: str
) -> None:
    result = helm_template(sets=sets)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert not result.stdout.strip(), "nothing is rendered for rejected values"


def test_policy_enum_is_the_operators_policy_list() -> None:
    schema_enum = SCHEMA["properties"]["servingPolicy"]["properties"]["policy"]["enum"]
    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert schema_enum == [name.upper() for name in POLICY_NAMES]
    assert schema_enum == spec["properties"]["policy"]["enum"]


def test_default_values_satisfy_the_schema() -> None:
    values = yaml.safe_load(VALUES_TEXT)
    jsonschema.Draft7Validator(SCHEMA).validate(values)


def test_ingress_annotations_null_is_valid_as_reused_values() -> None:
    """`--set ingress.annotations=null` drops the defaults; `helm upgrade --reuse-values` then
    validates the null itself, not the defaults merged over it."""
    values = yaml.safe_load(VALUES_TEXT)
    values["ingress"]["annotations"] = None
    jsonschema.Draft7Validator(SCHEMA).validate(values)
    rendered = helm_template(sets={"ingress.enabled": "true", "ingress.annotations": "null"})
    assert rendered.returncode == 0, rendered.stderr
    (ingress,) = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "Ingress"]
    assert "annotations" not in ingress["metadata"]


def test_values_file_links_its_schema() -> None:
    assert VALUES_TEXT.startswith("# yaml-language-server: $schema=values.schema.json\n")


def leaf_paths(node: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the values: leaves, empty maps and lists (users fill those in)."""
    if isinstance(node, dict) and node:
        paths: set[str] = set()
        for key, value in node.items():
            paths |= leaf_paths(value, f"{prefix}.{key}" if prefix else str(key))
        return paths
    return {prefix}


def test_every_value_is_documented_with_a_param_line() -> None:
    documented = set(re.findall(r"^\s*## @param (\S+) ", VALUES_TEXT, flags=re.MULTILINE))
    values = yaml.safe_load(VALUES_TEXT)
    # Resource and security-context maps are documented as a whole.
    whole = {
        "operator.resources",
        "operator.podSecurityContext",
        "operator.containerSecurityContext",
        "loadtest.resources",
        "loadtest.podSecurityContext",
        "loadtest.containerSecurityContext",
        "cleanup.resources",
        "tests.resources",
        "ingress.annotations",
        "dashboards.labels",
        "dashboards.annotations",
        # LabelSelectors and peer lists, documented by what they select.
        "networkPolicy.ingressController.namespaceSelector",
        "networkPolicy.ingressController.podSelector",
        "networkPolicy.prometheus.namespaceSelector",
        "networkPolicy.prometheus.podSelector",
        "networkPolicy.dns.peers",
    }
    expected = {
        path
        for path in leaf_paths(values)
        if not any(path.startswith(f"{prefix}.") for prefix in whole)
    } | whole
    assert sorted(expected - documented) == [], "values without a ## @param line"
    assert sorted(documented - expected) == [], "## @param lines for values that do not exist"


def test_every_schema_property_has_a_value_or_is_optional() -> None:
    """The schema and values.yaml describe the same tree (no stale schema branches)."""
    values = yaml.safe_load(VALUES_TEXT)

    def walk(schema: dict[str, Any], node: Any, path: str) -> None:
        for key in schema.get("required", []):
            assert isinstance(node, dict) and key in node, f"{path}.{key} required but unset"
        for key, sub in schema.get("properties", {}).items():
            if isinstance(node, dict) and key in node and sub.get("type") == "object":
                walk(sub, node[key], f"{path}.{key}")

    walk(SCHEMA, values, "")
