"""Placement on the real scheduler: a ServingPolicy's nodeSelector and tolerations put its vLLM
pods on a tainted GPU node, the router's own put the router elsewhere, and without the
toleration the vLLM pods stay pending, as on a cluster whose GPU nodes carry
`nvidia.com/gpu:NoSchedule`."""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.local import NODE_NAMES, node_manifest
from tests.cluster.helpers import HostOperator, Kube, MakePolicy, Release, condition, wait_for

pytestmark = pytest.mark.slow

POOL_LABEL = "arcserving.io/test-pool"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture
def gpu_node(kube: Kube) -> Iterator[tuple[str, str]]:
    """A kwok node labelled with a pool of its own and tainted as GPU nodes are: (node, pool)."""
    name = f"kwok-gpu-{secrets.token_hex(2)}"
    pool = f"gpu-{secrets.token_hex(2)}"
    # Pod CIDRs below the metrics node's range (test_status_metrics.py), past the cluster's.
    manifest = node_manifest(name, random.randint(16, 63))
    manifest["metadata"]["labels"][POOL_LABEL] = pool
    manifest["spec"]["taints"] = [GPU_TAINT]
    kube.run("apply", "-f", "-", input=json.dumps(manifest))

    def placed_pods() -> list[dict[str, Any]]:
        listed = kube.get("pods", "-A") or {"items": []}
        return [
            pod
            for pod in listed["items"]
            if (pod["spec"].get("nodeSelector") or {}).get(POOL_LABEL) == pool
            or pod["spec"].get("nodeName") == name
        ]

    try:
        wait_for(
            f"node {name} Ready",
            lambda: condition(kube.get("node", name) or {}, "Ready").get("status") == "True",
        )
        yield name, pool
    finally:
        # The tests' ServingPolicies are deleted by now; their pods go with the garbage
        # collector. Waiting for them leaves the namespace's serving pods as other tests expect.
        wait_for(f"the pods of pool {pool} gone", lambda: not placed_pods(), detail=placed_pods)
        kube.run("delete", "node", name, "--wait=false", check=False)


def pods(kube: Kube, ns: str, name: str, component: str) -> list[dict[str, Any]]:
    listed = kube.get(
        "pods",
        "-n",
        ns,
        "-l",
        f"arcserving.io/servingpolicy={name},app.kubernetes.io/component={component}",
    )
    return [
        p for p in (listed or {}).get("items", []) if not p["metadata"].get("deletionTimestamp")
    ]


def bound(kube: Kube, ns: str, name: str, component: str, count: int) -> list[dict[str, Any]]:
    found = [p for p in pods(kube, ns, name, component) if p["spec"].get("nodeName")]
    return found if len(found) == count else []


def test_serving_pods_go_to_the_tainted_gpu_node_and_the_router_where_it_is_told(
    kube: Kube,
    release: Release,
    host_operator: HostOperator,
    gpu_node: tuple[str, str],
    make_policy: MakePolicy,
) -> None:
    node, pool = gpu_node
    ns, name = release.namespace, "placed"
    router_node = NODE_NAMES[1]
    make_policy(
        name,
        replicas=2,
        nodeSelector={POOL_LABEL: pool},
        tolerations=[GPU_TOLERATION],
        routing={
            "policy": "round_robin",
            "nodeSelector": {"kubernetes.io/hostname": router_node},
        },
    )
    serving = wait_for("two vLLM pods bound", lambda: bound(kube, ns, name, "serving", 2))
    assert {p["spec"]["nodeName"] for p in serving} == {node}
    for pod in serving:
        assert pod["spec"]["nodeSelector"] == {POOL_LABEL: pool}
        assert GPU_TOLERATION in pod["spec"]["tolerations"]
    (router,) = wait_for("the router pod bound", lambda: bound(kube, ns, name, "router", 1))
    assert router["spec"]["nodeName"] == router_node
    # The vLLM pods' toleration is theirs alone (the API server adds its own defaults).
    assert GPU_TOLERATION not in router["spec"].get("tolerations", [])


def test_without_the_toleration_the_tainted_node_refuses_the_pods(
    kube: Kube,
    release: Release,
    host_operator: HostOperator,
    gpu_node: tuple[str, str],
    make_policy: MakePolicy,
) -> None:
    _, pool = gpu_node
    ns, name = release.namespace, "untolerated"
    make_policy(name, replicas=1, nodeSelector={POOL_LABEL: pool}, routing={"policy": "none"})

    def unschedulable() -> dict[str, Any] | None:
        for pod in pods(kube, ns, name, "serving"):
            scheduled = condition(pod, "PodScheduled")
            if scheduled.get("reason") == "Unschedulable":
                return scheduled
        return None

    scheduled = wait_for("the scheduler to refuse the vLLM pod", unschedulable)
    assert "untolerated taint" in scheduled["message"], scheduled
    assert not any(p["spec"].get("nodeName") for p in pods(kube, ns, name, "serving"))
