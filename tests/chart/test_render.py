"""The chart lints and renders for every values variant under ci/, and what it renders is valid.

Core objects are validated against the Kubernetes 1.35 schemas (kubernetes-validate, strict:
unknown fields fail); the ServingPolicy against the operator's CRD schema and its pydantic model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_helpers import (
    CHART,
    CI_VALUES,
    CRD_FILE,
    NAMESPACE,
    RBAC_FILE,
    RELEASE,
    by_kind,
    ci_values,
    helm_template,
    httproute_schema,
    one,
    render,
    run,
    tool,
)

from arc_operator import manifests, rbac
from arc_operator.__main__ import parse_args
from arc_operator.manifests import (
    PORT,
    PORT_NAME,
    ROUTER_METRICS_PORT_NAME,
    labels,
    pod_template,
    router_labels,
    router_pod_template,
)
from arc_operator.models import DEFAULT_FLEET_ROUTING, RoutingPolicy, parse_spec
from arc_serving_common.traces import read_trace

K8S_VERSION = "1.35.0"
# Kinds from CRDs: checked by their own tests (ServingPolicy against the CRD, the rest below).
CUSTOM_KINDS = {"ServingPolicy", "PodMonitor", "ServiceMonitor", "PrometheusRule", "HTTPRoute"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# helm refuses release names longer than 53 characters.
LONGEST_RELEASE = "r" * 53
# Resources without a namespace, which a RoleBinding cannot grant (the operator has none today).
CLUSTER_SCOPED = {
    "customresourcedefinitions",
    "namespaces",
    "nodes",
    "persistentvolumes",
    "clusterkopfpeerings",
    "clusterroles",
    "clusterrolebindings",
    "storageclasses",
    "ingressclasses",
    "priorityclasses",
}


# A spec the operator accepts, for labels it builds (any ServingPolicy's pods carry them).
CHART_SPEC = {
    "model": {"name": "m"},
    "image": "i:1",
    "cache": {"numBlocks": 512},
    "maxModelLen": 4096,
    "allowUnauthenticated": True,
}


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


def component(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The single rendered object of one kind that belongs to one chart component."""
    return one(
        [o for o in objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == name],
        kind,
    )


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
    assert spec["policy"] == "TRIO"
    assert spec["cache"] == {"blockSize": 16, "gpuMemoryUtilization": 0.9}
    assert spec["image"] == "ghcr.io/arc-serving/vllm:0.1.0"


def test_default_disruption_gives_the_documented_grace_period_and_no_budget() -> None:
    spec = parse_spec(one(render(), "ServingPolicy")["spec"])
    assert spec.disruption.model_dump(by_alias=True) == {
        "maxUnavailable": 1, "drainDelaySeconds": 5, "requestSeconds": None,
    }  # fmt: skip
    name = f"{RELEASE}-arc-serving"
    pod = manifests.deployment(name, NAMESPACE, spec)["spec"]["template"]["spec"]
    # docs/chart.md, "Disruptions": 5 + 8192 tokens at 50 tokens/s (164) + 10.
    assert pod["terminationGracePeriodSeconds"] == 179
    assert "PodDisruptionBudget" not in [
        c["kind"] for c in manifests.children(name, NAMESPACE, spec, [])
    ]


def test_disruption_values_reach_the_servingpolicy_and_its_budget() -> None:
    sets = {
        "servingPolicy.replicas": "3",
        "servingPolicy.disruption.maxUnavailable": "2",
        "servingPolicy.disruption.drainDelaySeconds": "0",
        "servingPolicy.disruption.requestSeconds": "300",
    }
    rendered = one(render(sets=sets), "ServingPolicy")["spec"]
    assert rendered["disruption"] == {
        "maxUnavailable": 2,
        "drainDelaySeconds": 0,
        "requestSeconds": 300,
    }
    spec = parse_spec(rendered)
    name = f"{RELEASE}-arc-serving"
    (budget,) = manifests.budgets(name, NAMESPACE, spec)
    assert budget["spec"]["maxUnavailable"] == 2
    pod = manifests.deployment(name, NAMESPACE, spec)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 0 + 300 + manifests.EXIT_MARGIN_S


def test_model_volume_reaches_the_servingpolicy_and_its_pods() -> None:
    spec = one(render(ci_values("model-volume-values.yaml")), "ServingPolicy")["spec"]
    assert spec["model"] == {
        "name": "/models/Qwen2.5-0.5B-Instruct",
        "servedName": "qwen",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}},
    }
    template = pod_template("rel", parse_spec(spec))["spec"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in (template["volumes"])


def test_host_path_model_volume_renders_only_its_source() -> None:
    sets = {
        "servingPolicy.model.name": "/models/qwen",
        "servingPolicy.model.volume.hostPath.path": "/srv/models",
    }
    spec = one(render(sets=sets), "ServingPolicy")["spec"]
    assert spec["model"]["volume"] == {"hostPath": {"path": "/srv/models"}}


def test_default_servingpolicy_serves_from_the_hub_without_a_volume() -> None:
    assert "volume" not in one(render(), "ServingPolicy")["spec"]["model"]


def test_cpu_variant_sizes_the_cache_in_blocks() -> None:
    spec = one(render(ci_values("cpu-values.yaml")), "ServingPolicy")["spec"]
    assert spec["cache"] == {"blockSize": 32, "numBlocks": 256}
    assert spec["resources"] == {"gpus": 0, "cpu": "2", "memory": "8Gi", "homeSizeLimit": "16Gi"}
    assert spec["env"][1]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def test_placement_reaches_the_servingpolicy_and_each_kind_of_pod() -> None:
    spec = one(render(ci_values("placement-values.yaml")), "ServingPolicy")["spec"]
    gpu_nodes = {
        "nvidia.com/gpu.present": "true",
        "node.kubernetes.io/instance-type": "a2-highgpu-1g",
    }
    assert spec["nodeSelector"] == gpu_nodes
    assert spec["tolerations"] == [
        GPU_TOLERATION,
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 60},
    ]  # fmt: skip
    routers = [{"key": "dedicated", "value": "routers", "effect": "NoSchedule"}]
    assert spec["routing"]["nodeSelector"] == {"pool": "cpu"}
    assert spec["routing"]["tolerations"] == routers
    # What the operator makes of it: each kind of pod placed by its own fields.
    parsed = parse_spec(spec)
    serving = pod_template("rel", parsed)["spec"]
    router = router_pod_template("rel", NAMESPACE, parsed, [], "router:1")["spec"]
    assert serving["nodeSelector"] == gpu_nodes and serving["tolerations"] == spec["tolerations"]
    assert router["nodeSelector"] == {"pool": "cpu"} and router["tolerations"] == routers


def test_the_hook_and_the_test_pod_are_placed_by_their_own_values() -> None:
    objects = render(ci_values("placement-values.yaml"))
    (hook,) = [o for o in by_kind(objects, "Job") if o["metadata"]["name"].endswith("-cleanup")]
    hook_pod = hook["spec"]["template"]["spec"]
    assert hook_pod["nodeSelector"] == {"pool": "cpu"}
    assert hook_pod["tolerations"] == [
        {"key": "dedicated", "value": "routers", "effect": "NoSchedule"}
    ]
    test_pod = one(objects, "Pod")["spec"]
    assert test_pod["nodeSelector"] == {"pool": "cpu"} and "tolerations" not in test_pod
    defaults = render()
    (hook,) = [o for o in by_kind(defaults, "Job") if o["metadata"]["name"].endswith("-cleanup")]
    assert "nodeSelector" not in hook["spec"]["template"]["spec"]
    assert "nodeSelector" not in one(defaults, "Pod")["spec"]


def test_default_servingpolicy_places_no_pod() -> None:
    spec = one(render(sets={"servingPolicy.replicas": "2"}), "ServingPolicy")["spec"]
    assert "nodeSelector" not in spec and "tolerations" not in spec
    assert "nodeSelector" not in spec["routing"] and "tolerations" not in spec["routing"]


def test_the_router_never_takes_the_engines_placement() -> None:
    sets = {
        "servingPolicy.replicas": "2",
        "servingPolicy.nodeSelector.pool": "gpu",
        "servingPolicy.tolerations[0].key": "nvidia.com/gpu",
        "servingPolicy.tolerations[0].operator": "Exists",
    }
    spec = one(render(sets=sets), "ServingPolicy")["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert set(spec["routing"]) == {"policy", "replicas", "resources"}


def test_label_values_that_read_as_booleans_stay_strings() -> None:
    result = helm_template(extra=["--set-string", "servingPolicy.nodeSelector.gpu=true"])
    assert result.returncode == 0, result.stderr
    policy = one([d for d in yaml.safe_load_all(result.stdout) if d], "ServingPolicy")
    assert policy["spec"]["nodeSelector"] == {"gpu": "true"}


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
    assert container["command"] == ["arc-operator"]
    assert "--all-namespaces" in container["args"]
    # ARC_OPERATOR_METRICS_PORT is left at its default, the engine pods' port; the downward
    # API's variables name the candidate on the Lease.
    env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    # The NetworkPolicy peers (tests/chart/test_network_policy.py checks what they admit).
    assert len(json.loads(env.pop("ARC_OPERATOR_SERVING_PEERS"))) == 2
    assert len(json.loads(env.pop("ARC_OPERATOR_MONITORING_PEERS"))) == 2
    assert env == {
        "ARC_OPERATOR_STATUS_INTERVAL": "30",
        "ARC_OPERATOR_ROUTER_IMAGE": "ghcr.io/arc-serving/router:0.1.0",
        "ARC_OPERATOR_NETWORK_POLICY": "true",
    }
    rules = yaml.safe_load(RBAC_FILE.read_text(encoding="utf-8"))
    assert one(objects, "ClusterRole")["rules"] == rules
    binding = one(objects, "ClusterRoleBinding")
    account = component(objects, "ServiceAccount", "operator")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_operator_confined_to_namespaces_gets_role_bindings_only_there() -> None:
    objects = render(ci_values("namespaced-values.yaml"))
    args = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    assert not by_kind(objects, "ClusterRoleBinding")
    role = one(objects, "ClusterRole")
    assert role["rules"] == yaml.safe_load(RBAC_FILE.read_text(encoding="utf-8"))
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert {b["subjects"][0]["name"] for b in bindings} == {"arc-operator"}
    assert {b["roleRef"]["name"] for b in bindings} == {role["metadata"]["name"]}
    assert not by_kind(objects, "ServiceAccount")
    # The Lease stays in the release namespace whatever the operator watches.
    (lease_binding,) = [b for b in by_kind(objects, "RoleBinding") if b not in bindings]
    assert lease_binding["metadata"]["namespace"] == NAMESPACE
    assert lease_binding["subjects"][0]["name"] == "arc-operator"


def test_operator_rules_are_all_namespaced_so_role_bindings_grant_them() -> None:
    rules = yaml.safe_load(RBAC_FILE.read_text(encoding="utf-8"))
    resources = {resource.split("/")[0] for rule in rules for resource in rule["resources"]}
    assert resources and not resources & CLUSTER_SCOPED, resources & CLUSTER_SCOPED


def test_watched_namespaces_including_the_release_namespace_reconcile_the_default_policy() -> None:
    objects = render(sets={"operator.watchNamespaces": f"{{{NAMESPACE},team-a}}"})
    assert one(objects, "ServingPolicy")["metadata"]["namespace"] == NAMESPACE
    namespaces = sorted(
        b["metadata"]["namespace"]
        for b in by_kind(objects, "RoleBinding")
        if b["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
        and b["roleRef"]["kind"] == "ClusterRole"
    )
    assert namespaces == sorted([NAMESPACE, "team-a"])


def operator_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return component(objects, "Deployment", "operator")


def operator_roles(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The operator's Roles or RoleBindings (not the cleanup hook's)."""
    return [
        o
        for o in by_kind(objects, kind)
        if o["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_operator_args_parse_and_elect_on_the_releases_lease(values: Path) -> None:
    deployment = operator_deployment(render(values))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # The operator's own parser (it exits 2 on an option it refuses).
    options = parse_args(container["args"], env={})
    assert options.lease_name == deployment["metadata"]["name"]
    assert options.lease_namespace == NAMESPACE
    assert options.liveness == "http://0.0.0.0:8080/healthz"
    downward = {
        var["name"]: var["valueFrom"]["fieldRef"]["fieldPath"]
        for var in container["env"]
        if "valueFrom" in var
    }
    assert downward == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}


@pytest.mark.parametrize("replicas", [1, 3])
def test_operator_replicas_roll_without_a_gap(replicas: int) -> None:
    sets = {} if replicas == 1 else {"operator.replicas": str(replicas)}
    spec = operator_deployment(render(sets=sets))["spec"]
    assert spec["replicas"] == replicas
    # A new pod waits as a follower, Ready, until the old one releases the Lease on SIGTERM.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_lease_role_grants_the_releases_lease_only_in_the_release_namespace(
    values: Path,
) -> None:
    objects = render(values)
    lease = operator_deployment(objects)["metadata"]["name"]
    account = operator_deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"]
    (role,) = operator_roles(objects, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == rbac.lease_rules(lease)
    bindings = operator_roles(objects, "RoleBinding")
    (binding,) = [b for b in bindings if b["roleRef"]["kind"] == "Role"]
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    # Every request the elector makes is granted; the Lease is the only object it may name.
    for verb in ("get", "update", "create"):
        assert rbac.allows(role["rules"], rbac.LEASE_GROUP, "leases", verb), verb
    for rule in role["rules"]:
        assert rule.get("resourceNames", [lease]) == [lease], rule
        assert set(rule["verbs"]) <= {"get", "update", "create"}, rule


def test_lease_rules_match_the_committed_file() -> None:
    committed = CHART / "files" / "operator-lease-rules.yaml"
    assert committed.read_text(encoding="utf-8") == rbac.render_lease_rules(), (
        "run: python -m arc_operator.rbac --lease PATH"
    )


def test_no_lease_role_without_chart_rbac() -> None:
    objects = render(sets={"operator.rbac.create": "false"})
    assert not operator_roles(objects, "Role") and not operator_roles(objects, "RoleBinding")


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
    # The operator names the Service after the ServingPolicy, with its port named PORT_NAME.
    service = one(objects, "ServingPolicy")["metadata"]["name"]
    assert backend == {"name": service, "port": {"name": PORT_NAME}}


def test_ingress_without_host_matches_every_host() -> None:
    ingress = one(render(sets={"ingress.enabled": "true"}), "Ingress")
    assert "host" not in ingress["spec"]["rules"][0]
    assert "tls" not in ingress["spec"]


def test_loadtest_master_and_workers_replay_the_trace_against_the_service_not_the_ingress(
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
        # The ingress routes only /v1: the load test also needs /tokenize and /metrics.
        f"--host=http://{RELEASE}-arc-serving.{NAMESPACE}.svc:{PORT}",
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
    assert f"--host=http://{RELEASE}-arc-serving.{NAMESPACE}.svc:{PORT}" in args


def test_loadtest_host_set_explicitly_wins_over_the_service() -> None:
    sets = {"loadtest.enabled": "true", "loadtest.trace.existingConfigMap": "t",
            "ingress.enabled": "true", "ingress.host": "llm.example.com",
            "loadtest.host": "https://llm.example.com"}  # fmt: skip
    master = next(
        j for j in by_kind(render(sets=sets), "Job") if "lt-master" in j["metadata"]["name"]
    )
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--host=https://llm.example.com" in args


def test_loadtest_through_the_ingress_reads_the_tokenizer_from_its_volume() -> None:
    sets = {"loadtest.enabled": "true", "loadtest.trace.existingConfigMap": "t",
            "loadtest.host": "https://llm.example.com",
            "loadtest.tokenizer.path": "/models/tiny-llama",
            "loadtest.tokenizer.volume.hostPath.path": "/srv/models"}  # fmt: skip
    jobs = [j for j in by_kind(render(sets=sets), "Job") if "-lt-" in j["metadata"]["name"]]
    assert len(jobs) == 2
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert "--tokenizer=/models/tiny-llama" in container["args"]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tokenizer")
        assert mount == {"name": "tokenizer", "mountPath": "/models", "readOnly": True}
        volume = next(v for v in pod["volumes"] if v["name"] == "tokenizer")
        assert volume == {
            "name": "tokenizer",
            "hostPath": {"path": "/srv/models", "type": "Directory"},
        }


def test_loadtest_without_a_tokenizer_asks_the_server() -> None:
    sets = {"loadtest.enabled": "true", "loadtest.trace.existingConfigMap": "t"}
    for job in (j for j in by_kind(render(sets=sets), "Job") if "-lt-" in j["metadata"]["name"]):
        pod = job["spec"]["template"]["spec"]
        assert not any(a.startswith("--tokenizer") for a in pod["containers"][0]["args"])
        assert "tokenizer" not in {v["name"] for v in pod["volumes"]}


def test_new_run_id_replaces_the_loadtest_jobs() -> None:
    base = {"loadtest.enabled": "true", "loadtest.trace.existingConfigMap": "t"}

    def job_names(sets: dict[str, str]) -> set[str]:
        jobs = by_kind(render(sets=sets), "Job")
        return {j["metadata"]["name"] for j in jobs if "-lt-" in j["metadata"]["name"]}

    first, again = job_names(base), job_names(base)
    rerun = job_names({**base, "loadtest.runId": "2"})
    assert first == again
    assert len(first) == 2 and not first & rerun


def test_helm_test_hook_checks_health_and_model() -> None:
    objects = render()
    pod = one(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    service = one(objects, "ServingPolicy")["metadata"]["name"]
    assert f"http://{service}:{PORT}/health" in script
    assert f"http://{service}:{PORT}/v1/models" in script
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


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics for matchLabels."""
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


# The labels the operator puts on the pods and Services of any ServingPolicy: the serving
# pods' and the router's (docs/architecture.md, "Routing").
ENGINE_LABELS = (labels("any"), pod_template("any", parse_spec(CHART_SPEC))["metadata"]["labels"])
ROUTER_LABELS = router_labels("any")


def test_monitors_select_engine_pods_and_label_series_by_servingpolicy() -> None:
    pod_monitor = component(render(ci_values("monitoring-values.yaml")), "PodMonitor", "engine")
    service_monitor = component(
        render(sets={"monitoring.serviceMonitor.enabled": "true"}), "ServiceMonitor", "engine"
    )
    for monitor, endpoints in (
        (pod_monitor, pod_monitor["spec"]["podMetricsEndpoints"]),
        (service_monitor, service_monitor["spec"]["endpoints"]),
    ):
        selector = monitor["spec"]["selector"]
        assert all(selects(selector, engine) for engine in ENGINE_LABELS)
        assert not selects(selector, ROUTER_LABELS), "the router's port http has no engine metrics"
        assert selector == {"matchLabels": selector["matchLabels"]}
        assert "app.kubernetes.io/instance" not in selector["matchLabels"], (
            "every ServingPolicy is scraped"
        )
        assert endpoints[0]["port"] == PORT_NAME and endpoints[0]["path"] == "/metrics"
        assert endpoints[0]["relabelings"] == [
            {
                "sourceLabels": ["__meta_kubernetes_pod_label_arcserving_io_servingpolicy"],
                "targetLabel": "servingpolicy",
            }
        ]
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert "namespaceSelector" not in service_monitor["spec"]


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_router_monitors_scrape_only_the_routers_metrics_port(kind: str) -> None:
    switch = "podMonitor" if kind == "PodMonitor" else "serviceMonitor"
    objects = render(sets={f"monitoring.{switch}.enabled": "true"})
    monitor = component(objects, kind, "router")
    selector = monitor["spec"]["selector"]
    assert selects(selector, ROUTER_LABELS)
    assert not any(selects(selector, engine) for engine in ENGINE_LABELS)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
    # vllm-router's --prometheus-port, as the operator names it on the router's pods and Service.
    assert (endpoint["port"], endpoint["path"]) == (ROUTER_METRICS_PORT_NAME, "/metrics")
    engine = component(objects, kind, "engine")
    engine_endpoint = engine["spec"]["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
    assert endpoint["relabelings"] == engine_endpoint[0]["relabelings"]
    assert endpoint["interval"] == engine_endpoint[0]["interval"]


def fleet_targets(objects: list[dict[str, Any]]) -> dict[str, str]:
    """Where the Ingress, the HTTPRoute, the load test and helm test send requests (Service
    names)."""
    ingress = one(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    (route_backend,) = one(objects, "HTTPRoute")["spec"]["rules"][0]["backendRefs"]
    master = next(j for j in by_kind(objects, "Job") if "lt-master" in j["metadata"]["name"])
    (host,) = [
        arg.removeprefix("--host=http://")
        for arg in master["spec"]["template"]["spec"]["containers"][0]["args"]
        if arg.startswith("--host=")
    ]
    script = one(objects, "Pod")["spec"]["containers"][0]["args"][0]
    (test_host,) = set(re.findall(r"http://([-a-z0-9.]+):8000/", script))
    assert route_backend["port"] == PORT
    return {
        "ingress": ingress["service"]["name"],
        "httproute": route_backend["name"],
        "loadtest": host.removesuffix(f".{NAMESPACE}.svc:{PORT}"),
        "test": test_host,
    }


# An HTTPRoute on Gateway "public" in the release namespace.
ROUTE = {"httpRoute.enabled": "true", "httpRoute.parentRefs[0].name": "public"}
TARGETS = {"ingress.enabled": "true", "loadtest.enabled": "true",
           "loadtest.trace.existingConfigMap": "t", **ROUTE}  # fmt: skip
CLIENTS = ("ingress", "httproute", "loadtest", "test")
ROUTER_RESOURCES = {"cpu": "1", "memory": "1Gi"}


@pytest.mark.parametrize(
    ("sets", "routing", "target"),
    [
        pytest.param({}, None, "rel-arc-serving", id="one-replica-no-router"),
        pytest.param(
            {"servingPolicy.replicas": "2"},
            {"policy": "kv_aware", "replicas": 1, "resources": ROUTER_RESOURCES},
            "rel-arc-serving-router",
            id="fleet-defaults-to-kv-aware",
        ),
        pytest.param(
            {"servingPolicy.replicas": "3", "servingPolicy.routing.policy": "none"},
            {"policy": "none"},
            "rel-arc-serving",
            id="fleet-without-router",
        ),
        pytest.param(
            {"servingPolicy.routing.policy": "round_robin"},
            {"policy": "round_robin", "replicas": 1, "resources": ROUTER_RESOURCES},
            "rel-arc-serving-router",
            id="one-replica-behind-a-router",
        ),
        pytest.param(
            {"servingPolicy.replicas": "0", "servingPolicy.routing.policy": "cache_aware"},
            {"policy": "cache_aware", "replicas": 1, "resources": ROUTER_RESOURCES},
            "rel-arc-serving-router",
            id="stopped-fleet-keeps-its-router-service",
        ),
    ],
)
def test_clients_target_the_router_exactly_when_routing_is_on(
    sets: dict[str, str], routing: dict[str, Any] | None, target: str
) -> None:
    objects = render(sets={**TARGETS, **sets})
    spec = one(objects, "ServingPolicy")["spec"]
    assert spec.get("routing") == routing
    assert fleet_targets(objects) == dict.fromkeys(CLIENTS, target)
    # The operator runs a router exactly when the chart sends clients to one.
    routed = parse_spec(spec).routing_policy is not RoutingPolicy.NONE
    assert routed == target.endswith("-router")


@pytest.mark.parametrize("replicas", [0, 1, 2, 5])
def test_chart_default_routing_is_the_operators(replicas: int) -> None:
    """With routing.policy unset, what the chart writes is what the operator would pick for
    the same spec without it (DEFAULT_FLEET_ROUTING for a fleet, none for one replica)."""
    spec = one(render(sets={"servingPolicy.replicas": str(replicas)}), "ServingPolicy")["spec"]
    chart = spec.get("routing", {}).get("policy", "none")
    without = {key: value for key, value in spec.items() if key != "routing"}
    assert chart == parse_spec(without).routing_policy.value
    if replicas > 1:
        assert chart == DEFAULT_FLEET_ROUTING.value


def test_routing_values_reach_the_servingpolicy_and_the_operator() -> None:
    objects = render(ci_values("routing-values.yaml"), sets=ROUTE)
    policy = one(objects, "ServingPolicy")
    assert policy["spec"]["routing"] == {
        "policy": "kv_aware",
        "replicas": 2,
        "resources": {"cpu": "2", "memory": "2Gi"},
        "args": ["--request-timeout-secs=900", "--log-level=info"],
    }
    assert fleet_targets(objects) == dict.fromkeys(CLIENTS, "chat-router")
    # The router image reaches the operator, never the spec (one setting rolls every router).
    operator = component(objects, "Deployment", "operator")
    env = {var["name"]: var.get("value") for var in
           operator["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    assert env["ARC_OPERATOR_ROUTER_IMAGE"] == "ghcr.io/arc-serving/router:0.1.0"


def test_router_image_pinned_by_digest_reaches_the_operator() -> None:
    digest = "sha256:" + "ab" * 32
    objects = render(sets={"router.image.digest": digest, "router.image.registry": "reg.local"})
    container = component(objects, "Deployment", "operator")["spec"]["template"]["spec"]
    env = {var["name"]: var.get("value") for var in container["containers"][0]["env"]}
    assert env["ARC_OPERATOR_ROUTER_IMAGE"] == f"reg.local/arc-serving/router@{digest}"


def test_notes_name_the_router_and_restart_it_on_key_rotation() -> None:
    text = notes("servingPolicy.replicas=2")
    assert "through the vLLM router (policy kv_aware), Service rel-arc-serving-router" in text
    assert f"port-forward service/{RELEASE}-arc-serving-router 8000:http" in text
    assert "rollout restart deployment/rel-arc-serving deployment/rel-arc-serving-router" in text
    assert "-router" not in notes()


def test_ingress_to_an_existing_service_without_the_default_servingpolicy() -> None:
    objects = render(
        sets={
            "servingPolicy.enabled": "false",
            "ingress.enabled": "true",
            "ingress.serviceName": "chat",
            "loadtest.enabled": "true",
            "loadtest.trace.existingConfigMap": "t",
        }
    )
    assert not by_kind(objects, "ServingPolicy")
    backend = one(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == "chat"
    master = next(j for j in by_kind(objects, "Job") if "lt-master" in j["metadata"]["name"])
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--host=http://chat.{NAMESPACE}.svc:{PORT}" in args


# --- the Gateway API HTTPRoute -----------------------------------------------------------------


def valid_httproute(route: dict[str, Any]) -> dict[str, Any]:
    """``route`` after checking it against the Gateway API's HTTPRoute CRD (v1.6.3, standard
    channel; OpenAPI v3.0, so draft 4 semantics); its CEL rules run in tests/cluster."""
    errors = sorted(
        f"{list(error.absolute_path)}: {error.message}"
        for error in jsonschema.Draft4Validator(httproute_schema()).iter_errors(route)
    )
    assert not errors, errors
    return route


def test_the_httproute_crd_schema_refuses_what_it_should() -> None:
    """The offline check is live: the CRD's own schema refuses a broken route."""
    validator = jsonschema.Draft4Validator(httproute_schema())
    route = one(render(sets=ROUTE), "HTTPRoute")
    broken = json.loads(json.dumps(route))
    broken["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    del broken["spec"]["parentRefs"][0]["name"]
    broken["spec"]["hostnames"] = ["LLM.example.com"]
    assert len(list(validator.iter_errors(broken))) == 3


@pytest.mark.parametrize("values", CI_VALUES, ids=ci_ids)
def test_httproutes_validate_against_the_gateway_api_crd(values: Path) -> None:
    # Without the chart's ServingPolicy the route needs a Service named.
    backend = {} if by_kind(render(values), "ServingPolicy") else {"httpRoute.serviceName": "chat"}
    (route,) = by_kind(render(values, sets={**ROUTE, **backend}), "HTTPRoute")
    valid_httproute(route)


def test_httproute_values_reach_the_route() -> None:
    objects = render(ci_values("httproute-values.yaml"))
    route = valid_httproute(one(objects, "HTTPRoute"))
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["name"] == f"{RELEASE}-arc-serving"
    assert route["metadata"]["labels"]["team"] == "ml-platform"
    assert route["metadata"]["labels"]["app.kubernetes.io/component"] == "httproute"
    assert route["spec"] == {
        "parentRefs": [
            {"name": "public", "namespace": "gateway-system", "sectionName": "https"},
            {"name": "public", "namespace": "gateway-system", "sectionName": "http"},
        ],
        "hostnames": ["llm.example.com"],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                # The fleet's router, as the Ingress would have it.
                "backendRefs": [{"name": f"{RELEASE}-arc-serving-router", "port": PORT}],
                "timeouts": {"request": "1h"},
            }
        ],
    }


def test_httproute_defaults_route_only_the_api_to_the_serving_service() -> None:
    objects = render(sets={**ROUTE, "ingress.enabled": "true"})
    route = valid_httproute(one(objects, "HTTPRoute"))
    (rule,) = route["spec"]["rules"]
    ingress = one(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]
    # The Ingress's paths, forwarded unchanged: /v1 only, no /metrics or /health.
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": ingress["path"]}}]
    assert "filters" not in rule and "timeouts" not in rule
    assert rule["backendRefs"] == [{"name": ingress["backend"]["service"]["name"], "port": PORT}]
    assert route["spec"]["parentRefs"] == [{"name": "public"}]
    assert "hostnames" not in route["spec"] and "annotations" not in route["metadata"]


def test_httproute_takes_exact_paths_timeouts_and_annotations() -> None:
    sets = {
        **ROUTE,
        "httpRoute.paths": "{/v1/completions,/v1/chat/completions}",
        "httpRoute.pathType": "Exact",
        "httpRoute.timeouts.request": "0s",
        "httpRoute.timeouts.backendRequest": "0s",
        "httpRoute.annotations.example\\.com/tier": "gold",
        "httpRoute.hostnames[0]": "*.llm.example.com",
    }
    route = valid_httproute(one(render(sets=sets), "HTTPRoute"))
    (rule,) = route["spec"]["rules"]
    assert [match["path"] for match in rule["matches"]] == [
        {"type": "Exact", "value": "/v1/completions"},
        {"type": "Exact", "value": "/v1/chat/completions"},
    ]
    assert rule["timeouts"] == {"request": "0s", "backendRequest": "0s"}
    assert route["metadata"]["annotations"] == {"example.com/tier": "gold"}
    assert route["spec"]["hostnames"] == ["*.llm.example.com"]


def test_no_httproute_unless_enabled() -> None:
    for values in CI_VALUES:
        if values.stem != "httproute-values":
            assert not by_kind(render(values), "HTTPRoute"), values.stem


def test_httproute_to_an_existing_service_without_the_default_servingpolicy() -> None:
    sets = {**ROUTE, "servingPolicy.enabled": "false", "httpRoute.serviceName": "chat"}
    route = valid_httproute(one(render(sets=sets), "HTTPRoute"))
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "chat", "port": PORT}]


def test_notes_show_how_to_reach_the_api_through_the_gateway() -> None:
    text = notes(*(f"{key}={value}" for key, value in ROUTE.items()))
    assert f"kubectl -n {NAMESPACE} get gateway public -o jsonpath" in text
    assert 'curl -H "Authorization: Bearer $API_KEY" http://GATEWAY_ADDRESS/v1/models' in text
    assert "port-forward" not in text
    named = notes(*(f"{key}={value}" for key, value in ROUTE.items()),
                  "httpRoute.hostnames[0]=llm.example.com")  # fmt: skip
    assert "http://llm.example.com/v1/models" in named and "GATEWAY_ADDRESS" not in named


def hook_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects of the pre-delete cleanup hook."""
    return [
        o
        for o in objects
        if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "pre-delete"
    ]


def test_pre_delete_hook_deletes_the_default_servingpolicy_and_waits() -> None:
    objects = render(ci_values("cpu-values.yaml"))
    hooks = hook_objects(objects)
    assert sorted(o["kind"] for o in hooks) == ["Job", "Role", "RoleBinding", "ServiceAccount"]
    job = one(hooks, "Job")
    weights = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooks}
    assert all(weights[kind] < weights["Job"] for kind in ("ServiceAccount", "Role", "RoleBinding"))
    for obj in hooks:
        policy = obj["metadata"]["annotations"]["helm.sh/hook-delete-policy"].split(",")
        assert {"before-hook-creation", "hook-succeeded"} <= set(policy), obj["kind"]
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    policy_name = one(objects, "ServingPolicy")["metadata"]["name"]
    assert args[:3] == ["delete", "servingpolicies.arcserving.io", policy_name]
    assert f"--namespace={NAMESPACE}" in args and "--wait=true" in args
    assert "--timeout=4m" in args and "--ignore-not-found" in args
    # The Job's own ServiceAccount may only touch ServingPolicies, in the release namespace.
    account = one(hooks, "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == account
    binding, role = one(hooks, "RoleBinding"), one(hooks, "Role")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["arcserving.io"],
            "resources": ["servingpolicies"],
            "verbs": ["get", "list", "watch", "delete"],
        }
    ]


@pytest.mark.parametrize(
    "sets",
    [{"servingPolicy.enabled": "false"}, {"cleanup.enabled": "false"}],
    ids=["no-default-servingpolicy", "cleanup-disabled"],
)
def test_no_pre_delete_hook_without_a_chart_managed_servingpolicy(sets: dict[str, str]) -> None:
    assert not hook_objects(render(sets=sets))


def notes(*sets: str) -> str:
    """NOTES.txt as `helm install --dry-run` prints it, with --set pairs."""
    args: list[str | Path] = [tool("helm"), "install", RELEASE, CHART, "--namespace", NAMESPACE]
    for pair in sets:
        args += ["--set", pair]
    result = run([*args, "--dry-run=client"])
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_show_how_to_reach_the_api_and_run_the_load_test() -> None:
    text = notes()
    assert (
        f"kubectl -n {NAMESPACE} port-forward service/{RELEASE}-arc-serving {PORT}:{PORT_NAME}"
        in text
    )
    assert "--set loadtest.enabled=true" in text
    assert f"helm test {RELEASE}" in text
    assert "arc-serving / ARC internals" in text


def test_notes_switch_the_chart_managed_policy_through_helm_not_kubectl() -> None:
    text = notes()
    assert "--reuse-values --set servingPolicy.policy=LRU" in text
    assert "patch servingpolicy" not in text and "edit servingpolicy" not in text


def test_notes_apply_the_crd_before_helm_upgrade() -> None:
    text = notes()
    assert text.index("kubectl apply -f <chart>/crds/") < text.index(
        f"helm upgrade {RELEASE} <chart> -n {NAMESPACE} --reuse-values\n"
    )


def test_notes_tell_to_delete_servingpolicies_before_uninstall_without_the_hook() -> None:
    text = notes("cleanup.enabled=false")
    delete = "kubectl delete servingpolicies --all --wait --all-namespaces"
    assert text.index(delete) < text.index(f"helm uninstall {RELEASE}")


def test_notes_mention_missing_metrics_only_with_dashboards() -> None:
    hint = "The dashboards need the engines' metrics"
    assert hint in notes()
    assert hint not in notes("dashboards.enabled=false")
    assert hint not in notes("monitoring.podMonitor.enabled=true")
