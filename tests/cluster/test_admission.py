"""The CRD's schema and CEL rules as the real API server enforces them: each invalid
ServingPolicy is refused at admission with a message naming the field; a valid one passes."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from tests.cluster.helpers import REPO, Kube, Release

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "operator" / "examples" / "servingpolicy-arc.yaml"


def _example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))


def _with(path: str, value: Any) -> dict[str, Any]:
    """The example with `spec.<path>` set (None deletes it)."""
    body = copy.deepcopy(_example())
    *parents, leaf = path.split(".")
    node = body["spec"]
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return body


# (id, body, fragments the API server's refusal must contain)
INVALID = [
    ("unknown-policy", _with("policy", "FIFO"), ['spec.policy: Unsupported value: "FIFO"']),
    ("negative-replicas", _with("replicas", -1), ["spec.replicas", "greater than or equal to 0"]),
    ("string-replicas", _with("replicas", "two"), ["spec.replicas", "integer"]),
    ("unknown-switch-mode", _with("switchMode", "Live"), ["spec.switchMode", "Unsupported value"]),
    ("block-size-not-16", _with("cache.blockSize", 24), ["spec.cache.blockSize", "multiple of 16"]),
    (
        "both-cache-sizes",
        _with("cache.gpuMemoryUtilization", 0.9),
        ["spec.cache", "oneOf"],
    ),
    ("no-cache-size", _with("cache.numBlocks", None), ["spec.cache"]),
    (
        "cache-smaller-than-max-model-len",
        _with("cache.numBlocks", 8),
        ["spec", "cache.numBlocks * cache.blockSize must be at least maxModelLen"],
    ),
    (
        "api-key-and-unauthenticated",
        _with("allowUnauthenticated", True),
        ["spec", "set apiKeySecretRef", "or allowUnauthenticated: true"],
    ),
    (
        "neither-api-key-nor-unauthenticated",
        _with("apiKeySecretRef", None),
        ["spec", "set apiKeySecretRef", "or allowUnauthenticated: true"],
    ),
    ("missing-image", _with("image", None), ["spec.image: Required value"]),
    ("empty-model", _with("model", {}), ["spec.model.name: Required value"]),
    ("bad-cpu-quantity", _with("resources.cpu", "four"), ["spec.resources.cpu", "should match"]),
    (
        "unknown-routing-policy",
        _with("routing.policy", "least_loaded"),
        ['spec.routing.policy: Unsupported value: "least_loaded"'],
    ),
    ("zero-router-replicas", _with("routing.replicas", 0), ["spec.routing.replicas"]),
    ("zero-max-model-len", _with("maxModelLen", 0), ["spec.maxModelLen"]),
    (
        "model-volume-with-a-hub-id",
        _with("model.volume", {"persistentVolumeClaim": {"claimName": "models"}}),
        ["spec.model", "model.name must be an absolute path under /models"],
    ),
    (
        "model-volume-with-two-sources",
        _with(
            "model.volume",
            {"persistentVolumeClaim": {"claimName": "models"}, "hostPath": {"path": "/srv"}},
        ),
        ["spec.model.volume", "oneOf"],
    ),
    (
        "node-selector-key-not-a-label-key",
        _with("nodeSelector", {"gpu type": "a100"}),
        ["spec.nodeSelector", "every key must be a label key"],
    ),
    (
        "node-selector-value-not-a-label-value",
        _with("routing.nodeSelector", {"pool": "cpu pool"}),
        ["spec.routing.nodeSelector.pool", "should match"],
    ),
    (
        "keyless-toleration-not-exists",
        _with("tolerations", [{"value": "present"}]),
        ["spec.tolerations[0]", "operator must be Exists when key is empty"],
    ),
    (
        "exists-toleration-with-a-value",
        _with("tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "x"}]),
        ["spec.tolerations[0]", "value must be empty when operator is Exists"],
    ),
    (
        "toleration-seconds-without-no-execute",
        _with("routing.tolerations", [{"key": "spot", "tolerationSeconds": 30}]),
        ["spec.routing.tolerations[0]", "tolerationSeconds needs effect NoExecute"],
    ),
    (
        "unknown-taint-effect",
        _with("tolerations", [{"key": "nvidia.com/gpu", "effect": "NoAdmit"}]),
        ['spec.tolerations[0].effect: Unsupported value: "NoAdmit"'],
    ),
    (
        "comparison-toleration-operator",
        _with("tolerations", [{"key": "gpu-count", "operator": "Gt", "value": "3"}]),
        ['spec.tolerations[0].operator: Unsupported value: "Gt"'],
    ),
]


@pytest.mark.parametrize(
    ("body", "fragments"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_servingpolicy_is_refused_naming_the_field(
    kube: Kube, release: Release, body: dict[str, Any], fragments: list[str]
) -> None:
    body = copy.deepcopy(body)
    body["metadata"]["name"] = "invalid"
    result = kube.run(
        "create", "-n", release.namespace, "-f", "-", input=json.dumps(body), check=False
    )
    assert result.returncode != 0, f"accepted: {result.stdout}"
    assert "is invalid" in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert kube.get("servingpolicy", "invalid", "-n", release.namespace) is None


def test_example_servingpolicy_passes_server_dry_run(kube: Kube, release: Release) -> None:
    result = kube.run(
        "create", "--dry-run=server", "-n", release.namespace, "-o", "json", "-f", str(EXAMPLE)
    )
    stored = json.loads(result.stdout)
    # Defaults the schema declares are filled in by the API server.
    assert stored["spec"]["switchMode"] == "Hot"
    assert stored["spec"]["allowUnauthenticated"] is False
    assert stored["spec"]["cache"]["blockSize"] == 16
    assert not result.stderr, result.stderr


def test_placement_is_stored_as_written(kube: Kube, release: Release) -> None:
    placement = {
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
             "effect": "NoExecute", "tolerationSeconds": 300},
            {"operator": "Exists", "effect": ""},
        ],
    }  # fmt: skip
    body = _with("routing", {"nodeSelector": {"pool": "cpu"}, "tolerations": []})
    body["spec"].update(placement)
    result = kube.run(
        "create", "--dry-run=server", "-n", release.namespace, "-o", "json", "-f", "-",
        input=json.dumps(body),
    )  # fmt: skip
    stored = json.loads(result.stdout)["spec"]
    assert {key: stored[key] for key in placement} == placement
    assert stored["routing"]["nodeSelector"] == {"pool": "cpu"}
    assert not result.stderr, result.stderr


def test_unknown_field_is_pruned_or_refused(kube: Kube, release: Release) -> None:
    body = _with("colour", "blue")
    body["metadata"]["name"] = "pruned"
    strict = kube.run(
        "create",
        "--dry-run=server",
        "--validate=strict",
        "-n",
        release.namespace,
        "-f",
        "-",
        input=json.dumps(body),
        check=False,
    )
    assert strict.returncode != 0
    assert 'unknown field "spec.colour"' in strict.stderr, strict.stderr
    lax = kube.run(
        "create",
        "--dry-run=server",
        "--validate=false",
        "-n",
        release.namespace,
        "-o",
        "json",
        "-f",
        "-",
        input=json.dumps(body),
    )
    assert "colour" not in json.loads(lax.stdout)["spec"]
