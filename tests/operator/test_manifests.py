"""Pure tests of the spec model, the manifests, the CRD and the RBAC rules."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from arc_operator import crd, manifests, rbac
from arc_operator.models import OperatorConfig, SpecError, parse_spec
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV, POLICY_NAMES
from tests.operator.conftest import make_spec

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"
# Peers as the chart passes them: a namespace-and-pod pair and an address block.
PEERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}},
    },
    {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
]


def test_valid_spec_parses_with_defaults() -> None:
    spec = parse_spec(make_spec(policy="ARC"))
    assert spec.policy_name == "arc"
    assert spec.model.served == "qwen"
    assert parse_spec({k: v for k, v in make_spec().items() if k != "replicas"}).replicas == 1


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"policy": "FIFO"}, "spec.policy: Input should be 'LRU'"),
        ({"replicas": -1}, "spec.replicas: Input should be greater than or equal to 0"),
        ({"cache": {"blockSize": 16}}, "exactly one of numBlocks or gpuMemoryUtilization"),
        (
            {"cache": {"numBlocks": 8, "gpuMemoryUtilization": 0.9}},
            "exactly one of numBlocks or gpuMemoryUtilization",
        ),
        ({"cache": {"blockSize": 24, "numBlocks": 512}}, "spec.cache.blockSize"),
        ({"cache": {"numBlocks": 4}, "maxModelLen": 4096}, "cannot serve maxModelLen=4096"),
        ({"engineArgs": ["--block-size=32"]}, "engineArgs may not set --block-size"),
        # vLLM reads _ as - in flag names, and accepts unambiguous prefixes.
        ({"engineArgs": ["--block_size", "32"]}, "engineArgs may not set --block-size"),
        ({"engineArgs": ["--max_model_len=9"]}, "engineArgs may not set --max-model-len"),
        ({"engineArgs": ["--block-si", "32"]}, "engineArgs may not set --block-size"),
        ({"resources": {"cpu": "four"}}, "spec.resources.cpu: String should match pattern"),
        ({"resources": {"memory": "-1Gi"}}, "spec.resources.memory: String should match"),
        ({"env": [{"name": POLICY_ENV, "value": "lru"}]}, "env may not set"),
        ({"env": [{"name": "PROMETHEUS_MULTIPROC_DIR", "value": "/x"}]}, "env may not set"),
        ({"color": "blue"}, "spec.color: Extra inputs are not permitted"),
        # The API key: only from a Secret, never as a literal in env or on the command line.
        ({"env": [{"name": "VLLM_API_KEY", "value": "k"}]}, "env may not set VLLM_API_KEY"),
        ({"engineArgs": ["--api-key", "k"]}, "engineArgs may not set --api-key"),
        ({"engineArgs": ["--api_key=k"]}, "engineArgs may not set --api-key"),
        ({"apiKeySecretRef": None}, "apiKeySecretRef is required"),
        (
            {"apiKeySecretRef": {"name": "k"}, "allowUnauthenticated": True},
            "set apiKeySecretRef or allowUnauthenticated: true, not both",
        ),
        ({"apiKeySecretRef": {"name": "Bad_Name"}}, "spec.apiKeySecretRef.name: String should"),
        ({"apiKeySecretRef": {"name": "k", "key": "a/b"}}, "spec.apiKeySecretRef.key: String"),
        ({"apiKeySecretRef": {"name": "k", "key": ".."}}, "'..' is not a valid Secret data key"),
        ({"apiKeySecretRef": {"key": "api-key"}}, "spec.apiKeySecretRef.name: Field required"),
    ],
)
def test_invalid_spec_is_rejected_naming_the_problem(changes: dict, problem: str) -> None:
    with pytest.raises(SpecError, match=None) as caught:
        parse_spec(make_spec(**changes))
    assert problem in str(caught.value)


def test_policy_enum_follows_the_registry() -> None:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    enum = schema["properties"]["spec"]["properties"]["policy"]["enum"]
    assert enum == [name.upper() for name in POLICY_NAMES]


@pytest.mark.parametrize("mode", ["Hot", "Restart"])
@pytest.mark.parametrize(
    "cache", [{"numBlocks": 512}, {"blockSize": 32, "gpuMemoryUtilization": 0.85}]
)
def test_children_validate_against_kubernetes_schemas(mode: str, cache: dict) -> None:
    spec = parse_spec(
        make_spec(
            switchMode=mode,
            cache=cache,
            env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
        )
    )
    for child in manifests.children("demo", "serving", spec, PEERS):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def template_of(mode: str, policy: str) -> dict:
    spec = parse_spec(make_spec(switchMode=mode, policy=policy))
    return manifests.deployment("demo", "serving", spec)["spec"]["template"]


def test_only_restart_mode_puts_the_policy_in_the_pod_template() -> None:
    assert template_of("Hot", "LRU") == template_of("Hot", "ARC")
    assert template_of("Restart", "LRU") != template_of("Restart", "ARC")


def test_hot_pods_mount_the_policy_configmap() -> None:
    template = template_of("Hot", "ARC")
    (container,) = template["spec"]["containers"]
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env[CONFIG_ENV] == "/etc/arc-evictor/policy.json"
    assert POLICY_ENV not in env
    assert {"name": "policy", "configMap": {"name": "demo-policy"}} in template["spec"]["volumes"]
    assert {"name": "policy", "mountPath": "/etc/arc-evictor", "readOnly": True} in container[
        "volumeMounts"
    ]


def test_restart_pods_take_the_policy_from_env_and_never_read_the_configmap() -> None:
    # A mounted policy file would switch old pods live; Restart pods only see their env.
    template = template_of("Restart", "ARC")
    (container,) = template["spec"]["containers"]
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env[POLICY_ENV] == "arc"
    assert CONFIG_ENV not in env
    assert "policy" not in {volume["name"] for volume in template["spec"]["volumes"]}
    assert "policy" not in {mount["name"] for mount in container["volumeMounts"]}
    # The ConfigMap still records the policy (for people and tools reading it).
    spec = parse_spec(make_spec(switchMode="Restart", policy="ARC"))
    assert manifests.config_map("demo", "serving", spec)["data"] == {
        "policy.json": '{"policy": "arc"}\n'
    }


def test_the_deployment_is_applied_before_the_policy_configmap() -> None:
    kinds = [
        child["kind"]
        for child in manifests.children("demo", "serving", parse_spec(make_spec()), PEERS)
    ]
    assert kinds.index("Deployment") < kinds.index("ConfigMap")


def test_deployment_args_follow_the_spec() -> None:
    spec = parse_spec(make_spec(engineArgs=["--max-num-seqs", "8"]))
    template = manifests.deployment("demo", "serving", spec)["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["args"] == [
        "--host", "0.0.0.0", "--port", "8000",
        "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen",
        "--block-size", "16", "--enable-prefix-caching",
        "--num-gpu-blocks-override", "512", "--max-model-len", "4096",
        "--shutdown-timeout", "82",  # 4096 tokens at 50 tokens/s, rounded up
        "--max-num-seqs", "8",
    ]  # fmt: skip
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env[CONFIG_ENV] == "/etc/arc-evictor/policy.json"
    # The plugin's metrics leave the engine-core process through multiprocess files.
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/var/run/arc-evictor/prometheus"
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    assert mounts["prometheus"] == "/var/run/arc-evictor/prometheus"
    assert volumes["prometheus"]["emptyDir"] == {"sizeLimit": "256Mi"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_manifests_are_pure_functions_of_the_spec() -> None:
    spec = parse_spec(make_spec())
    assert manifests.children("a", "ns", spec, PEERS) == manifests.children("a", "ns", spec, PEERS)


def test_crd_validates_and_matches_the_committed_file() -> None:
    kubernetes_validate.validate(crd.build_crd(), K8S_VERSION, strict=True)
    committed = ROOT / "charts/arc-serving/crds/servingpolicies.arcserving.io.yaml"
    assert committed.read_text() == crd.render_crd(), "run: python -m arc_operator.crd PATH"


def test_rbac_rules_match_the_committed_file() -> None:
    committed = ROOT / "charts/arc-serving/files/operator-rbac-rules.yaml"
    assert yaml.safe_load(committed.read_text()) == rbac.RULES
    assert committed.read_text() == rbac.render_rules()
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "arc-serving-operator"},
        "rules": rbac.RULES,
    }
    kubernetes_validate.validate(role, K8S_VERSION, strict=True)


def test_example_servingpolicy_is_valid() -> None:
    example = yaml.safe_load((ROOT / "operator/examples/servingpolicy-arc.yaml").read_text())
    assert parse_spec(example["spec"]).policy_name == "arc"


def test_operator_settings_name_the_bad_variable() -> None:
    assert OperatorConfig.from_env({}).metrics_port == 8000
    with pytest.raises(SpecError, match="ARC_OPERATOR_STATUS_INTERVAL='-1'"):
        OperatorConfig.from_env({"ARC_OPERATOR_STATUS_INTERVAL": "-1"})


def engine_container(spec: dict) -> dict:
    (container,) = manifests.pod_template("demo", parse_spec(spec))["spec"]["containers"]
    return container


def test_api_key_reaches_the_pod_only_through_a_secret_key_ref() -> None:
    container = engine_container(make_spec(apiKeySecretRef={"name": "demo-keys"}))
    (key_var,) = [var for var in container["env"] if var["name"] == "VLLM_API_KEY"]
    # key defaults to "api-key"; a missing Secret fails the pod's start instead of opening it.
    assert key_var == {
        "name": "VLLM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "demo-keys", "key": "api-key", "optional": False}},
    }
    assert not any("api-key" in arg or "api_key" in arg for arg in container["args"])


def test_opting_out_of_authentication_is_explicit_and_sets_no_key() -> None:
    spec = make_spec(allowUnauthenticated=True)
    del spec["apiKeySecretRef"]
    assert parse_spec(spec).allow_unauthenticated
    names = [var["name"] for var in engine_container(spec)["env"]]
    assert "VLLM_API_KEY" not in names


def test_api_key_ref_is_in_no_configmap() -> None:
    spec = parse_spec(make_spec(apiKeySecretRef={"name": "demo-keys", "key": "k1"}))
    (configmap,) = [
        c for c in manifests.children("demo", "ns", spec, PEERS) if c["kind"] == "ConfigMap"
    ]
    assert "demo-keys" not in str(configmap) and "VLLM_API_KEY" not in str(configmap)


# --- the serving pods' NetworkPolicy, telemetry, annotations ----------------------------------


def test_network_policy_admits_only_the_peers_on_port_8000() -> None:
    spec = parse_spec(make_spec())
    children = manifests.children("demo", "serving", spec, PEERS)
    (policy,) = [c for c in children if c["kind"] == "NetworkPolicy"]
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    assert policy["metadata"]["namespace"] == "serving"
    # It selects exactly this ServingPolicy's pods.
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"ports": [{"port": 8000, "protocol": "TCP"}], "from": PEERS}
    ]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)


def test_no_peers_admit_nothing_and_the_opt_out_makes_no_policy() -> None:
    spec = parse_spec(make_spec())
    (policy,) = [
        c for c in manifests.children("demo", "ns", spec, []) if c["kind"] == "NetworkPolicy"
    ]
    assert policy["spec"]["ingress"] == [] and policy["spec"]["policyTypes"] == ["Ingress"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    kinds = [c["kind"] for c in manifests.children("demo", "ns", spec, None)]
    assert kinds == ["Deployment", "Service", "ConfigMap"]


def test_operator_settings_carry_validated_peers() -> None:
    config = OperatorConfig.from_env({"ARC_OPERATOR_SERVING_PEERS": json.dumps(PEERS)})
    assert config.peers() == PEERS
    assert OperatorConfig.from_env({}).peers() == []
    off = {"ARC_OPERATOR_NETWORK_POLICY": "false", "ARC_OPERATOR_SERVING_PEERS": "[]"}
    assert OperatorConfig.from_env(off).peers() is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("not json", "not a JSON list of NetworkPolicyPeer"),
        ('{"podSelector": {}}', "valid tuple"),
        ("[{}]", "podSelector and/or namespaceSelector, or ipBlock alone"),
        ('[{"podSelector": {}, "ipBlock": {"cidr": "10.0.0.0/8"}}]', "ipBlock alone"),
        ('[{"podSelector": {"matchLabel": {}}}]', "[0][podSelector][matchLabel]: Extra inputs"),
        ('[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]', "pattern"),
    ],
)
def test_bad_peers_stop_the_operator_naming_the_variable(value: str, problem: str) -> None:
    with pytest.raises(SpecError, match=r"ARC_OPERATOR_SERVING_PEERS=") as error:
        OperatorConfig.from_env({"ARC_OPERATOR_SERVING_PEERS": value})
    assert problem in str(error.value)


def test_serving_pods_send_no_usage_telemetry() -> None:
    container = engine_container(make_spec())
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    with pytest.raises(SpecError, match="VLLM_NO_USAGE_STATS"):
        parse_spec(make_spec(env=[{"name": "VLLM_NO_USAGE_STATS", "value": "0"}]))


def test_live_children_carry_no_annotations() -> None:
    # Scanner skips belong to the audit's rendering (arc_operator.render), not to the cluster.
    for child in manifests.children("demo", "ns", parse_spec(make_spec()), PEERS):
        assert "annotations" not in child["metadata"], child["kind"]


@pytest.mark.parametrize("module", ["crd", "rbac"])
@pytest.mark.parametrize("argv", [["--help"], ["-o"], ["a.yaml", "b.yaml"]])
def test_generators_refuse_bad_arguments_and_write_nothing(
    module: str, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    generator = importlib.import_module(f"arc_operator.{module}")
    assert generator.main(argv) == 2
    assert f"usage: python -m arc_operator.{module} [OUTPUT.yaml]" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_printer_columns_show_the_routing_policy_in_effect() -> None:
    columns = crd.build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    names = [column["name"] for column in columns if "priority" not in column]
    assert names == ["Policy", "Routing", "Ready", "Hit Rate", "Age"]
    (routing,) = [column for column in columns if column["name"] == "Routing"]
    assert routing["jsonPath"] == ".status.routingPolicy"


PVC_MODEL = {
    "name": "/models/qwen",
    "servedName": "qwen",
    "volume": {"persistentVolumeClaim": {"claimName": "models"}},
}


def test_model_volume_is_mounted_read_only_and_the_pod_runs_offline() -> None:
    spec = make_spec(model=PVC_MODEL)
    template = manifests.pod_template("demo", parse_spec(spec))["spec"]
    (container,) = template["containers"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in template["volumes"]
    assert container["args"][container["args"].index("--model") + 1] == "/models/qwen"
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]


def test_host_path_model_must_be_an_existing_directory() -> None:
    model = {"name": "/models", "volume": {"hostPath": {"path": "/srv/models/qwen"}}}
    volumes = manifests.pod_template("demo", parse_spec(make_spec(model=model)))["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/srv/models/qwen", "type": "Directory"}} in (
        volumes
    )


def test_without_a_volume_nothing_is_mounted_and_the_hub_stays_reachable() -> None:
    container = engine_container(make_spec())
    assert not any(mount["name"] == "model" for mount in container["volumeMounts"])
    assert "HF_HUB_OFFLINE" not in {var["name"] for var in container["env"]}
    # Without a volume, HF_HUB_OFFLINE stays the user's to set (an image with the model inside).
    parse_spec(make_spec(env=[{"name": "HF_HUB_OFFLINE", "value": "1"}]))


@pytest.mark.parametrize("source", [PVC_MODEL["volume"], {"hostPath": {"path": "/srv/m"}}])
def test_model_volume_children_validate_against_kubernetes_schemas(source: dict) -> None:
    spec = parse_spec(make_spec(model={"name": "/models/qwen", "volume": source}))
    for child in manifests.children("demo", "serving", spec, PEERS):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        (
            {**PVC_MODEL, "name": "Qwen/Qwen2.5-0.5B-Instruct"},
            "spec.model: with model.volume, model.name must be an absolute path under /models",
        ),
        ({**PVC_MODEL, "name": "/data/qwen"}, "must be an absolute path under /models"),
        ({**PVC_MODEL, "name": "/modelsx"}, "must be an absolute path under /models"),
        ({**PVC_MODEL, "name": "/models/../etc"}, "must be an absolute path under /models"),
        (
            {"name": "/models/q", "volume": {}},
            "spec.model.volume: exactly one of persistentVolumeClaim or hostPath",
        ),
        (
            {
                "name": "/models/q",
                "volume": {
                    "persistentVolumeClaim": {"claimName": "m"},
                    "hostPath": {"path": "/srv"},
                },
            },
            "spec.model.volume: exactly one of persistentVolumeClaim or hostPath",
        ),
        (
            {"name": "/models/q", "volume": {"persistentVolumeClaim": {"claimName": "Models"}}},
            "spec.model.volume.persistentVolumeClaim.claimName: String should match pattern",
        ),
        (
            {"name": "/models/q", "volume": {"hostPath": {"path": "srv/models"}}},
            "spec.model.volume.hostPath.path: String should match pattern",
        ),
        (
            {"name": "/models/q", "volume": {"hostPath": {"path": "/srv/../etc"}}},
            "spec.model.volume.hostPath.path: '/srv/../etc' may not contain '..'",
        ),
        (
            {"name": "/models/q", "volume": {"nfs": {"server": "x", "path": "/"}}},
            "spec.model.volume.nfs: Extra inputs are not permitted",
        ),
    ],
)
def test_bad_model_volume_is_refused_naming_the_field(model: dict, problem: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(make_spec(model=model))
    assert problem in str(caught.value)


def test_env_may_not_undo_offline_mode_with_a_volume() -> None:
    with pytest.raises(SpecError, match="env may not set HF_HUB_OFFLINE"):
        parse_spec(make_spec(model=PVC_MODEL, env=[{"name": "HF_HUB_OFFLINE", "value": "0"}]))


# --- placement: nodeSelector and tolerations of the serving and the router pods --------------

GPU_NODES = {"nvidia.com/gpu.present": "true", "cloud.google.com/gke-nodepool": "gpu-a100"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# Every toleration field, the empty strings Kubernetes reads as Equal and "every effect" too.
EVERY_TOLERATION_FIELD = [
    GPU_TOLERATION,
    {"key": "dedicated", "value": "llm", "effect": ""},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
     "tolerationSeconds": 300},
    {"key": "spot", "operator": "", "value": "true", "effect": "PreferNoSchedule"},
    {"operator": "Exists"},
]  # fmt: skip


def placed_pods(spec: dict) -> tuple[dict, dict]:
    """The serving and the router pod spec of ``spec`` (routed by round_robin)."""
    parsed = parse_spec(make_spec(**spec))
    serving = manifests.pod_template("demo", parsed)["spec"]
    router = manifests.router_pod_template("demo", "ns", parsed, [], "router:1")["spec"]
    return serving, router


def test_serving_placement_reaches_the_serving_pods_and_not_the_router() -> None:
    serving, router = placed_pods(
        {
            "nodeSelector": GPU_NODES,
            "tolerations": EVERY_TOLERATION_FIELD,
            "routing": {"policy": "round_robin"},
        }
    )
    assert serving["nodeSelector"] == GPU_NODES
    # Passed through as written, in order: the API server reads them as Kubernetes does.
    assert serving["tolerations"] == EVERY_TOLERATION_FIELD
    assert "nodeSelector" not in router and "tolerations" not in router


def test_the_router_has_a_placement_of_its_own() -> None:
    cpu_nodes = {"node-role.example.com/cpu": ""}
    spot = [{"key": "spot", "operator": "Exists"}]
    serving, router = placed_pods(
        {
            "nodeSelector": GPU_NODES,
            "tolerations": [GPU_TOLERATION],
            "routing": {"policy": "kv_aware", "nodeSelector": cpu_nodes, "tolerations": spot},
        }
    )
    assert router["nodeSelector"] == cpu_nodes and router["tolerations"] == spot
    assert serving["nodeSelector"] == GPU_NODES and serving["tolerations"] == [GPU_TOLERATION]


def test_without_placement_the_pod_specs_are_as_before() -> None:
    # No empty fields: a spec without placement leaves running pods' templates unchanged.
    for pod in placed_pods({"routing": {"policy": "round_robin"}}):
        assert "nodeSelector" not in pod and "tolerations" not in pod
    for pod in placed_pods(
        {"nodeSelector": {}, "tolerations": [], "routing": {"policy": "random"}}
    ):
        assert "nodeSelector" not in pod and "tolerations" not in pod


def test_placement_changes_roll_only_the_pods_they_place() -> None:
    base = {"routing": {"policy": "round_robin"}}
    serving, router = placed_pods(base)
    moved_serving, same_router = placed_pods({**base, "tolerations": [GPU_TOLERATION]})
    assert moved_serving != serving and same_router == router
    same_serving, moved_router = placed_pods(
        {"routing": {"policy": "round_robin", "nodeSelector": {"pool": "cpu"}}}
    )
    assert same_serving == serving and moved_router != router


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_placed_children_validate_against_kubernetes_schemas(policy: str) -> None:
    spec = parse_spec(
        make_spec(
            nodeSelector=GPU_NODES,
            tolerations=EVERY_TOLERATION_FIELD,
            routing={"policy": policy, "nodeSelector": {"pool": "cpu"},
                     "tolerations": [{"key": "spot", "operator": "Exists"}]},
        )
    )  # fmt: skip
    endpoints = [manifests.Endpoint("demo-0", "10.0.0.1")]
    children = [
        *manifests.children("demo", "serving", spec, PEERS),
        *manifests.router_children("demo", "serving", spec, endpoints, image="r:1", peers=PEERS),
    ]
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
    # The render command writes the children as YAML: plain strings, no enum objects.
    assert yaml.safe_load(yaml.safe_dump(children)) == children


LABEL_KEY_PROBLEM = "is not a label key: a name of at most 63 characters"
KEYLESS = "operator must be Exists when key is empty"
SELECTOR_VALUE = "spec.nodeSelector.pool: String should"
FIRST = "spec.tolerations[0]"


def toleration(**fields: object) -> dict:
    return {"tolerations": [{"key": "gpu", **fields}]}


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"nodeSelector": {"gpu type": "a"}}, f"spec.nodeSelector: 'gpu type' {LABEL_KEY_PROBLEM}"),
        ({"nodeSelector": {"a/b/c": "x"}}, f"spec.nodeSelector: 'a/b/c' {LABEL_KEY_PROBLEM}"),
        # A prefix is a DNS subdomain: lower case.
        ({"nodeSelector": {"Example.com/gpu": "x"}}, LABEL_KEY_PROBLEM),
        ({"nodeSelector": {"/gpu": "x"}}, LABEL_KEY_PROBLEM),
        ({"nodeSelector": {"g" * 64: "x"}}, LABEL_KEY_PROBLEM),
        ({"nodeSelector": {f"{'p' * 254}/gpu": "x"}}, LABEL_KEY_PROBLEM),
        ({"nodeSelector": {"pool": "gpu pool"}}, f"{SELECTOR_VALUE} match pattern"),
        ({"nodeSelector": {"pool": "-gpu"}}, f"{SELECTOR_VALUE} match pattern"),
        ({"nodeSelector": {"pool": "g" * 64}}, f"{SELECTOR_VALUE} have at most 63 characters"),
        ({"nodeSelector": {"pool": 1}}, "spec.nodeSelector.pool: Input should be a valid string"),
        (
            {"nodeSelector": {f"k{i}": "v" for i in range(65)}},
            "spec.nodeSelector: Dictionary should have at most 64 items",
        ),
        ({"tolerations": [{"value": "x"}]}, f"{FIRST}: {KEYLESS}"),
        ({"tolerations": [{"key": "", "operator": "Equal"}]}, f"{FIRST}: {KEYLESS}"),
        (
            {"tolerations": [GPU_TOLERATION, {"key": "gpu", "operator": "Exists", "value": "y"}]},
            "spec.tolerations[1]: value must be empty when operator is Exists",
        ),
        (
            toleration(operator="Exists", tolerationSeconds=60),
            f"{FIRST}: tolerationSeconds needs effect NoExecute",
        ),
        (
            toleration(effect="NoSchedule", tolerationSeconds=60),
            f"{FIRST}: tolerationSeconds needs effect NoExecute",
        ),
        (toleration(operator="In"), f"{FIRST}.operator: Input should be '', 'Equal' or 'Exists'"),
        # Alpha in Kubernetes 1.35, behind a feature gate a cluster may not have.
        (toleration(operator="Gt", value="3"), f"{FIRST}.operator: Input should be"),
        (toleration(effect="NoAdmit"), f"{FIRST}.effect: Input should be '', 'NoSchedule'"),
        ({"tolerations": [{"key": "gpu type"}]}, f"{FIRST}.key: 'gpu type' {LABEL_KEY_PROBLEM}"),
        (toleration(value="a b"), f"{FIRST}.value: String should match pattern"),
        (
            toleration(effect="NoExecute", tolerationSeconds=1.5),
            f"{FIRST}.tolerationSeconds: Input should be a valid integer",
        ),
        (toleration(taint="x"), f"{FIRST}.taint: Extra inputs are not permitted"),
        ({"tolerations": [GPU_TOLERATION] * 65}, "spec.tolerations: List should have at most 64"),
        ({"tolerations": GPU_TOLERATION}, "spec.tolerations: Input should be a valid array"),
        (
            {"routing": {"policy": "kv_aware", "tolerations": [{"operator": "Equal"}]}},
            f"spec.routing.tolerations[0]: {KEYLESS}",
        ),
        (
            {"routing": {"nodeSelector": {"a b": "c"}}},
            f"spec.routing.nodeSelector: 'a b' {LABEL_KEY_PROBLEM}",
        ),
    ],
)
def test_bad_placement_is_refused_naming_the_field(changes: dict, problem: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(make_spec(**changes))
    assert problem in str(caught.value)


@pytest.mark.parametrize(
    "key",
    [
        "a",
        "gpu",
        "nvidia.com/gpu",
        "node.kubernetes.io/unreachable",
        "A_b.C-d",
        "g" * 63,
        f"{'p' * 253}/gpu",
        "gpu type",
        "g" * 64,
        f"{'p' * 254}/gpu",
        "Example.com/gpu",
        "a/b/c",
        "-gpu",
        "gpu.",
        "/gpu",
        "gpu/",
    ],
)
def test_the_crd_judges_label_keys_as_the_operator_does(key: str) -> None:
    """The CEL rule over nodeSelector keys and the toleration key's schema refuse exactly the
    keys the operator refuses (CEL's RE2 and Python read these patterns alike)."""
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    (rule,) = spec["properties"]["nodeSelector"]["x-kubernetes-validations"]
    cel = re.fullmatch(
        r"self\.all\(k, k\.matches\(r'(.+)'\) && k\.indexOf\('/'\) <= (\d+)\)", rule["rule"]
    )
    assert cel is not None, rule["rule"]
    pattern, prefix = cel[1], int(cel[2])
    by_cel = re.search(pattern, key) is not None and key.find("/") <= prefix
    toleration = spec["properties"]["tolerations"]["items"]
    key_schema = toleration["properties"]["key"]
    prefix_rule = f"!has(self.key) || self.key.indexOf('/') <= {prefix}"
    assert prefix_rule in [rule["rule"] for rule in toleration["x-kubernetes-validations"]]
    by_schema = (
        re.search(key_schema["pattern"], key) is not None
        and len(key) <= key_schema["maxLength"]
        and key.find("/") <= prefix
    )
    try:
        parse_spec(make_spec(nodeSelector={key: "x"}, tolerations=[{"key": key}]))
    except SpecError:
        by_operator = False
    else:
        by_operator = True
    assert by_cel == by_schema == by_operator
