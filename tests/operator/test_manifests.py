"""Pure tests of the spec model, the manifests, the CRD and the RBAC rules."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from arc_operator import crd, manifests, rbac
from arc_operator.models import OperatorConfig, SpecError, parse_spec

from arc_evictor.policies import policy_names
from tests.operator.conftest import make_spec

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"


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
        ({"env": [{"name": "ARC_EVICTOR_POLICY", "value": "lru"}]}, "env may not set"),
        ({"env": [{"name": "PROMETHEUS_MULTIPROC_DIR", "value": "/x"}]}, "env may not set"),
        ({"color": "blue"}, "spec.color: Extra inputs are not permitted"),
    ],
)
def test_invalid_spec_is_rejected_naming_the_problem(changes: dict, problem: str) -> None:
    with pytest.raises(SpecError, match=None) as caught:
        parse_spec(make_spec(**changes))
    assert problem in str(caught.value)


def test_policy_enum_follows_the_registry() -> None:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    enum = schema["properties"]["spec"]["properties"]["policy"]["enum"]
    assert enum == [name.upper() for name in policy_names()]


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
    for child in manifests.children("demo", "serving", spec):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_only_restart_mode_puts_the_policy_in_the_pod_template() -> None:
    def template(mode: str, policy: str) -> dict:
        spec = parse_spec(make_spec(switchMode=mode, policy=policy))
        return manifests.deployment("demo", "serving", spec)["spec"]["template"]

    assert template("Hot", "LRU") == template("Hot", "ARC")
    assert template("Restart", "LRU") != template("Restart", "ARC")


def test_deployment_args_follow_the_spec() -> None:
    spec = parse_spec(make_spec(engineArgs=["--max-num-seqs", "8"]))
    template = manifests.deployment("demo", "serving", spec)["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["args"] == [
        "--host", "0.0.0.0", "--port", "8000",
        "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--served-model-name", "qwen",
        "--block-size", "16", "--enable-prefix-caching",
        "--num-gpu-blocks-override", "512", "--max-model-len", "4096",
        "--max-num-seqs", "8",
    ]  # fmt: skip
    assert container["env"][0] == {
        "name": "ARC_EVICTOR_CONFIG",
        "value": "/etc/arc-evictor/policy.json",
    }
    # The plugin's metrics leave the engine-core process through multiprocess files.
    assert container["env"][1] == {
        "name": "PROMETHEUS_MULTIPROC_DIR",
        "value": "/var/run/arc-evictor/prometheus",
    }
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    assert mounts["prometheus"] == "/var/run/arc-evictor/prometheus"
    assert volumes["prometheus"] == {"name": "prometheus", "emptyDir": {}}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_manifests_are_pure_functions_of_the_spec() -> None:
    spec = parse_spec(make_spec())
    assert manifests.children("a", "ns", spec) == manifests.children("a", "ns", spec)


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
