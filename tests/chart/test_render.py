"""The chart lints and renders for every values variant under ci/, and what it renders is valid.

Core objects are validated against the Kubernetes 1.35 schemas (kubernetes-validate, strict:
unknown fields fail); the ServingPolicy against the operator's CRD schema and its pydantic model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from arc_operator.models import parse_spec
from chart_helpers import (
    CHART,
    CI_VALUES,
    CRD_FILE,
    NAMESPACE,
    RBAC_FILE,
    RELEASE,
    by_kind,
    ci_values,
    one,
    render,
    run,
    tool,
)

from arc_evictor.traces import read_trace

K8S_VERSION = "1.35.0"
# Kinds from CRDs: checked by their own tests (ServingPolicy against the CRD, the rest below).
CUSTOM_KINDS = {"ServingPolicy", "PodMonitor", "ServiceMonitor", "PrometheusRule"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# helm refuses release names longer than 53 characters.
LONGEST_RELEASE = "r" * 53


def ci_ids(path: Path) -> str:
    return path.stem


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) for every pod the chart renders directly or through a template."""
    specs = []
    for obj in objects:
        if obj["kind"] == "Pod":
            specs.append((obj["metadata"]["name"], obj["spec"]))
        elif obj["kind"] in {"Deployment", "Job"}:
            specs.append((obj["metadata"]["name"], obj["spec"]["template"]["spec"]))
    return specs


def test_ci_variants_exist() -> None:
    assert len(CI_VALUES) >= 5, "the chart keeps its values variants under ci/"


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_helm_lint_passes(values: Path) -> None:
    result = run([tool("helm"), "lint", "--strict", CHART, "--values", values])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_core_objects_validate_against_kubernetes_schema(values: Path) -> None:
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_servingpolicy_matches_crd_and_operator_model(values: Path) -> None:
    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    # The CRD schema is OpenAPI v3.0 (boolean exclusiveMinimum): JSON Schema draft 4 semantics.
    validator = jsonschema.Draft4Validator(schema)
    for policy in by_kind(render(values), "ServingPolicy"):
        version = crd["spec"]["versions"][0]["name"]
        assert policy["apiVersion"] == f"{crd['spec']['group']}/{version}"
        errors = sorted(str(error.message) for error in validator.iter_errors(policy))
        assert not errors, errors
        parse_spec(policy["spec"])  # the operator's own validation (raises SpecError)


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_object_names_fit_dns_labels_for_the_longest_release_name(values: Path) -> None:
    objects = render(values, release=LONGEST_RELEASE)
    names = [obj["metadata"]["name"] for obj in objects]
    for name in names:
        assert len(name) <= 63 and DNS_LABEL.match(name), name
    # The ConfigMap the operator names after the ServingPolicy must fit too.
    for policy in by_kind(objects, "ServingPolicy"):
        assert len(policy["metadata"]["name"] + "-policy") <= 63
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(set(keys)) == len(keys), "two objects share a name"


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_every_pod_runs_non_root_with_a_read_only_root(values: Path) -> None:
    for name, spec in pod_specs(render(values)):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert "resources" in container, name


def test_default_servingpolicy_reflects_values() -> None:
    policy = one(render(), "ServingPolicy")
    assert policy["metadata"] == {**policy["metadata"], "name": f"{RELEASE}-arc-serving"}
    spec = policy["spec"]
    assert spec["policy"] == "ARC"
    assert spec["cache"] == {"blockSize": 16, "gpuMemoryUtilization": 0.9}
    assert spec["image"] == "ghcr.io/arc-serving/vllm:0.1.0"


def test_cpu_variant_sizes_the_cache_in_blocks() -> None:
    spec = one(render(ci_values("cpu-values.yaml")), "ServingPolicy")["spec"]
    assert spec["cache"] == {"blockSize": 32, "numBlocks": 256}
    assert spec["resources"] == {"gpus": 0, "cpu": "2", "memory": "8Gi"}
    assert spec["env"][1]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}


def test_null_unsets_the_default_cache_size() -> None:
    spec = one(
        render(
            sets={
                "servingPolicy.cache.numBlocks": "1024",
                "servingPolicy.cache.gpuMemoryUtilization": "null",
            }
        ),
        "ServingPolicy",
    )["spec"]
    assert spec["cache"] == {"blockSize": 16, "numBlocks": 1024}


def test_operator_watches_all_namespaces_with_a_cluster_role() -> None:
    objects = render()
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kopf"]
    assert container["args"][:3] == ["run", "-m", "arc_operator.handlers"]
    assert "--all-namespaces" in container["args"]
    env = {var["name"]: var["value"] for var in container["env"]}
    assert env == {"ARC_OPERATOR_METRICS_PORT": "8000", "ARC_OPERATOR_STATUS_INTERVAL": "30"}
    rules = yaml.safe_load(RBAC_FILE.read_text(encoding="utf-8"))
    assert one(objects, "ClusterRole")["rules"] == rules
    binding = one(objects, "ClusterRoleBinding")
    account = one(objects, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_operator_confined_to_namespaces_gets_role_bindings_only_there() -> None:
    objects = render(ci_values("namespaced-values.yaml"))
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    assert not by_kind(objects, "ClusterRoleBinding") or all(
        binding["roleRef"]["name"].endswith("-operator-cluster")
        for binding in by_kind(objects, "ClusterRoleBinding")
    )
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert {b["subjects"][0]["name"] for b in bindings} == {"arc-operator"}
    assert not by_kind(objects, "ServiceAccount")
    # Namespaced and cluster-scoped rules together are exactly the operator's rules.
    granted = [rule for role in by_kind(objects, "ClusterRole") for rule in role["rules"]]
    rules = yaml.safe_load(RBAC_FILE.read_text(encoding="utf-8"))
    assert sorted(map(str, granted)) == sorted(map(str, rules))


def test_operator_rbac_never_grants_wildcards_or_secrets() -> None:
    for role in by_kind(render(), "ClusterRole"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "secrets" not in rule["resources"], rule


def test_ingress_streams_to_the_servingpolicy_service() -> None:
    objects = render(ci_values("ingress-loadtest-values.yaml"))
    ingress = one(objects, "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert annotations["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [
        {"hosts": ["llm.example.com"], "secretName": "llm.example.com-tls"}
    ]
    rule = ingress["spec"]["rules"][0]
    assert rule["host"] == "llm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    # The operator names the Service after the ServingPolicy; port "http" is 8000.
    service = one(objects, "ServingPolicy")["metadata"]["name"]
    assert backend == {"name": service, "port": {"name": "http"}}


def test_ingress_without_host_matches_every_host() -> None:
    ingress = one(render(sets={"ingress.enabled": "true"}), "Ingress")
    assert "host" not in ingress["spec"]["rules"][0]
    assert "tls" not in ingress["spec"]


def test_loadtest_master_and_workers_replay_the_trace_against_the_ingress(
    tmp_path: Path,
) -> None:
    values = ci_values("ingress-loadtest-values.yaml")
    objects = render(values)
    jobs = {
        job["metadata"]["labels"]["app.kubernetes.io/component"]: job
        for job in by_kind(objects, "Job")
    }
    master, worker = jobs["loadtest-master"], jobs["loadtest-worker"]
    master_args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    worker_args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert master_args[:2] == worker_args[:2] == ["-f", "/app/loadtest/locustfile.py"]
    for expected in (
        "--master",
        "--headless",
        "--expect-workers=3",
        "--host=https://llm.example.com",
        "--run-time=15m",
        "--users=16",
        "--trace=/trace/trace.jsonl",
        "--trace-format=mooncake",
        "--seed=7",
        "--time-scale=0.5",
        "--model=Qwen/Qwen2.5-0.5B-Instruct",
    ):
        assert expected in master_args
    assert worker["spec"]["parallelism"] == worker["spec"]["completions"] == 3
    service = next(s for s in by_kind(objects, "Service") if s["spec"].get("clusterIP") == "None")
    assert "--worker" in worker_args
    assert f"--master-host={service['metadata']['name']}" in worker_args
    master_labels = master["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= master_labels.items()
    worker_labels = worker["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker_labels.items()
    # The inlined trace reaches the pods intact and is a trace the project can read.
    trace_map = next(c for c in by_kind(objects, "ConfigMap") if "trace.jsonl" in c.get("data", {}))
    volume = master["spec"]["template"]["spec"]["volumes"][0]
    assert volume["configMap"]["name"] == trace_map["metadata"]["name"]
    inline = yaml.safe_load(values.read_text(encoding="utf-8"))["loadtest"]["trace"]["inline"]
    assert trace_map["data"]["trace.jsonl"] == inline.strip()
    trace = tmp_path / "trace.jsonl"
    trace.write_text(trace_map["data"]["trace.jsonl"], encoding="utf-8")
    requests = list(read_trace(trace, fmt="mooncake"))
    assert [r.hash_ids for r in requests] == [(0, 1), (0, 1, 2), (3,)]


def test_loadtest_with_existing_trace_configmap_renders_no_trace_configmap() -> None:
    objects = render(ci_values("namespaced-values.yaml"))
    assert not by_kind(objects, "ConfigMap")
    master = next(j for j in by_kind(objects, "Job") if "lt-master" in j["metadata"]["name"])
    pod = master["spec"]["template"]["spec"]
    assert pod["volumes"][0]["configMap"] == {
        "name": "bailian-trace",
        "items": [{"key": "bailian.jsonl", "path": "bailian.jsonl"}],
    }
    args = pod["containers"][0]["args"]
    assert "--host=http://chat.team-a.svc:8000" in args
    assert "--block-tokens=16" in args and "--loglevel=DEBUG" in args


def test_loadtest_without_ingress_targets_the_serving_service() -> None:
    objects = render(sets={"loadtest.enabled": "true", "loadtest.trace.existingConfigMap": "t"})
    master = next(j for j in by_kind(objects, "Job") if "lt-master" in j["metadata"]["name"])
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--host=http://{RELEASE}-arc-serving.{NAMESPACE}.svc:8000" in args


def test_new_run_id_replaces_the_loadtest_jobs() -> None:
    base = {"loadtest.enabled": "true", "loadtest.trace.existingConfigMap": "t"}
    first = {j["metadata"]["name"] for j in by_kind(render(sets=base), "Job")}
    again = {j["metadata"]["name"] for j in by_kind(render(sets=base), "Job")}
    rerun = {
        j["metadata"]["name"] for j in by_kind(render(sets={**base, "loadtest.runId": "2"}), "Job")
    }
    assert first == again
    assert len(first) == 2 and not first & rerun


def test_helm_test_hook_checks_health_and_model() -> None:
    objects = render()
    pod = one(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    service = one(objects, "ServingPolicy")["metadata"]["name"]
    assert f"http://{service}:8000/health" in script
    assert f"http://{service}:8000/v1/models" in script
    assert '"id":"Qwen/Qwen2.5-0.5B-Instruct"' in script


def test_dashboards_configmap_carries_the_dashboard_files_for_the_sidecar() -> None:
    config_map = next(
        c
        for c in by_kind(render(ci_values("monitoring-values.yaml")), "ConfigMap")
        if c["metadata"]["labels"].get("grafana_dashboard") == "1"
    )
    assert config_map["metadata"]["namespace"] == "monitoring"
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert config_map["data"] == {
        f"arc-serving-{path.name}": path.read_text(encoding="utf-8").rstrip("\n") for path in files
    }


def test_monitors_select_engine_pods_and_label_series_by_servingpolicy() -> None:
    objects = render(ci_values("monitoring-values.yaml"))
    pod_monitor, service_monitor = one(objects, "PodMonitor"), one(objects, "ServiceMonitor")
    # The labels the operator puts on engine pods and Services (conventions).
    engine_labels = {
        "app.kubernetes.io/name": "arc-serving-engine",
        "app.kubernetes.io/managed-by": "arc-serving-operator",
    }
    for monitor, endpoints in (
        (pod_monitor, pod_monitor["spec"]["podMetricsEndpoints"]),
        (service_monitor, service_monitor["spec"]["endpoints"]),
    ):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= engine_labels.items()
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert endpoints[0]["port"] == "http" and endpoints[0]["path"] == "/metrics"
        assert endpoints[0]["relabelings"] == [
            {
                "sourceLabels": ["__meta_kubernetes_pod_label_arcserving_io_servingpolicy"],
                "targetLabel": "servingpolicy",
            }
        ]
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert "namespaceSelector" not in service_monitor["spec"]


def test_notes_show_how_to_reach_the_api_and_run_the_load_test() -> None:
    result = run(
        [tool("helm"), "install", RELEASE, CHART, "--namespace", NAMESPACE, "--dry-run=client"]
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward service/{RELEASE}-arc-serving 8000:http" in notes
    assert "--set loadtest.enabled=true" in notes
    assert f"helm test {RELEASE}" in notes
    assert "arc-serving / ARC internals" in notes
