"""ServingPolicy lifecycles on the real API server with the host operator: a hot switch changes
only the ConfigMap, a restart switch rolls the pods, scaling to two replicas brings the router
and back to one takes it away, and deleting the ServingPolicy lets the real garbage collector
remove every child."""

from __future__ import annotations

from typing import Any

import pytest

from arc_serving_common.names import POLICY_ENV
from tests.cluster.helpers import (
    Kube,
    MakePolicy,
    Release,
    condition,
    configured_policy,
    patch,
    ready_pods,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow

ROUTER_CHILDREN = ("deployment", "service", "serviceaccount", "networkpolicy")
SERVING_CHILDREN = ("deployment", "service", "networkpolicy")


def test_hot_switch_changes_only_the_configmap(
    kube: Kube, release: Release, make_policy: MakePolicy
) -> None:
    ns, name = release.namespace, "hot"
    make_policy(name, replicas=1, policy="ARC", switchMode="Hot")
    wait_for("one ready pod", lambda: len(ready_pods(kube, ns, name)) == 1)
    wait_for("the first report", lambda: reported(kube, ns, name))
    before = kube.get("deployment", name, "-n", ns)
    pods_before = {p["metadata"]["name"] for p in ready_pods(kube, ns, name)}
    assert before is not None
    patch(kube, ns, name, {"policy": "LRU"})
    wait_for(
        "the ConfigMap to say lru",
        lambda: configured_policy(kube, ns, name) == {"policy": "lru"},
    )
    sp = wait_for("the report on generation 2", lambda: reported(kube, ns, name))
    assert sp["metadata"]["generation"] == 2
    after = kube.get("deployment", name, "-n", ns)
    assert after is not None
    # The pod template did not change: no rollout, the same pods serve on.
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert {p["metadata"]["name"] for p in ready_pods(kube, ns, name)} == pods_before
    table = kube.run("get", "servingpolicy", name, "-n", ns).stdout.splitlines()
    assert table[1].split()[:3] == [name, "LRU", "none"]


def test_restart_switch_rolls_the_pods(
    kube: Kube, release: Release, make_policy: MakePolicy
) -> None:
    ns, name = release.namespace, "restart"
    make_policy(name, replicas=1, policy="ARC", switchMode="Restart")
    wait_for("one ready pod", lambda: len(ready_pods(kube, ns, name)) == 1)
    deployment = kube.get("deployment", name, "-n", ns)
    assert deployment is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": POLICY_ENV, "value": "arc"} in container["env"]
    # Restart mode mounts no ConfigMap: the policy comes from the template.
    assert all("configMap" not in v for v in deployment["spec"]["template"]["spec"]["volumes"])
    old_pods = {p["metadata"]["name"] for p in ready_pods(kube, ns, name)}
    patch(kube, ns, name, {"policy": "LRU"})

    def rolled() -> bool:
        d = kube.get("deployment", name, "-n", ns) or {}
        env = d["spec"]["template"]["spec"]["containers"][0]["env"]
        pods = {p["metadata"]["name"] for p in ready_pods(kube, ns, name)}
        status = d.get("status", {})
        return (
            {"name": POLICY_ENV, "value": "lru"} in env
            and status.get("observedGeneration") == d["metadata"]["generation"]
            and status.get("updatedReplicas") == 1
            and status.get("replicas") == 1
            and len(pods) == 1
            and not pods & old_pods
        )

    wait_for("the rollout to a new pod with lru", rolled)
    sp = wait_for("the report on generation 2", lambda: reported(kube, ns, name))
    assert condition(sp, "Valid")["status"] == "True"


def test_scale_to_two_adds_the_router_and_back_to_one_removes_it(
    kube: Kube, release: Release, make_policy: MakePolicy
) -> None:
    ns, name = release.namespace, "scale"
    make_policy(name, replicas=1)
    sp = wait_for("the first report", lambda: reported(kube, ns, name))
    assert sp["status"]["routingPolicy"] == "none"
    for kind in ROUTER_CHILDREN:
        assert kube.get(kind, f"{name}-router", "-n", ns) is None
    patch(kube, ns, name, {"replicas": 2})
    for kind in ROUTER_CHILDREN:
        wait_for(
            f"{kind}/{name}-router", lambda kind=kind: kube.get(kind, f"{name}-router", "-n", ns)
        )
    wait_for("two ready pods", lambda: len(ready_pods(kube, ns, name)) == 2)

    def router_ready() -> dict[str, Any] | None:
        sp = reported(kube, ns, name)
        return sp if sp and condition(sp, "RouterReady").get("status") == "True" else None

    sp = wait_for("RouterReady", router_ready)
    assert sp["status"]["routingPolicy"] == "kv_aware"
    router = kube.get("deployment", f"{name}-router", "-n", ns)
    assert router is not None
    args = " ".join(router["spec"]["template"]["spec"]["containers"][0]["args"])
    # kv_aware gets the ready pods as workers; kwok gives each pod an IP.
    for pod in ready_pods(kube, ns, name):
        assert pod["status"]["podIP"] in args, args
    patch(kube, ns, name, {"replicas": 1})
    for kind in ROUTER_CHILDREN:
        wait_for(
            f"{kind}/{name}-router to go",
            lambda kind=kind: kube.get(kind, f"{name}-router", "-n", ns) is None,
        )
    sp = wait_for("the report on generation 3", lambda: reported(kube, ns, name))
    assert sp["status"]["routingPolicy"] == "none"
    assert "RouterReady" not in {c["type"] for c in sp["status"]["conditions"]}


@pytest.mark.parametrize("cascade", ["background", "foreground"])
def test_delete_lets_the_garbage_collector_remove_every_child(
    kube: Kube, release: Release, make_policy: MakePolicy, cascade: str
) -> None:
    """Background: the ServingPolicy goes once the operator drops its finalizer, then the
    collector deletes the children. Foreground: the collector deletes the children first (their
    owner references block the owner's deletion), then the ServingPolicy goes."""
    ns, name = release.namespace, f"gone-{cascade}"
    make_policy(name, replicas=2)
    children = [(k, name) for k in SERVING_CHILDREN] + [
        ("configmap", f"{name}-policy"),
        *((k, f"{name}-router") for k in ROUTER_CHILDREN),
    ]
    for kind, child in children:
        wait_for(f"{kind}/{child}", lambda kind=kind, child=child: kube.get(kind, child, "-n", ns))
    wait_for("two ready pods", lambda: len(ready_pods(kube, ns, name)) == 2)
    # The operator removes its finalizer, so the delete completes.
    kube.run("delete", "servingpolicy", name, "-n", ns, f"--cascade={cascade}", "--timeout=60s")
    assert kube.get("servingpolicy", name, "-n", ns) is None
    for kind, child in children:
        wait_for(
            f"{kind}/{child} to be collected",
            lambda kind=kind, child=child: kube.get(kind, child, "-n", ns) is None,
        )
    wait_for("the serving pods to go", lambda: not ready_pods(kube, ns, name))
    # Nothing came back: the operator did not recreate a child of the deleted owner. (Checked
    # after a later event: a new pass of the operator over another ServingPolicy.)
    make_policy(f"{name}-after", replicas=1)
    wait_for("a later report", lambda: reported(kube, ns, f"{name}-after"))
    for kind, child in children:
        assert kube.get(kind, child, "-n", ns) is None, f"{kind}/{child} came back"


def test_discovery_routing_gets_a_role_the_api_server_lets_the_operator_grant(
    kube: Kube, release: Release, make_policy: MakePolicy
) -> None:
    """round_robin discovers the pods through the API: the operator creates a Role (pods get,
    list, watch) and its RoleBinding, which the real API server allows only because the
    operator holds those permissions itself (RBAC's escalation check, which kmock lacks)."""
    ns, name = release.namespace, "discovery"
    make_policy(name, replicas=2, routing={"policy": "round_robin"})
    role = wait_for("the router's Role", lambda: kube.get("role", f"{name}-router", "-n", ns))
    assert {(tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]} == {
        (("pods",), ("get", "list", "watch"))
    }
    binding = wait_for(
        "the router's RoleBinding", lambda: kube.get("rolebinding", f"{name}-router", "-n", ns)
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{name}-router", "namespace": ns}
    ]
    sa = f"system:serviceaccount:{ns}:{name}-router"
    can = kube.run("auth", "can-i", "list", "pods", "-n", ns, "--as", sa, check=False)
    assert can.stdout.strip() == "yes"

    def router_ready() -> dict[str, Any] | None:
        sp = reported(kube, ns, name)
        return sp if sp and condition(sp, "RouterReady").get("status") == "True" else None

    sp = wait_for("RouterReady", router_ready)
    assert sp["status"]["routingPolicy"] == "round_robin"
    patch(kube, ns, name, {"routing": {"policy": "kv_aware"}})
    for kind in ("role", "rolebinding"):
        wait_for(
            f"{kind}/{name}-router to go",
            lambda kind=kind: kube.get(kind, f"{name}-router", "-n", ns) is None,
        )
    assert kube.get("deployment", f"{name}-router", "-n", ns) is not None
