"""The operator SIGKILLed while it creates the children of a new ServingPolicy, then started
again: it converges with no duplicate (one of each child, each owned once, by the
ServingPolicy) and no orphan (every object of the ServingPolicy has an owner; nothing of the
generation before the kill is left).

The operator talks to the API server through a slow link (`SlowLink`, every request held
0.4 s), so its applies come seconds apart and the kill, on a watch event of the child named,
lands between two of them; the state at the kill is read back and checked to be mid-way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.cluster.helpers import (
    HostOperator,
    Kube,
    MakePolicy,
    Release,
    SlowLink,
    Watch,
    api_server_address,
    condition,
    patch,
    ready_pods,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow

POLICY_LABEL = "arcserving.io/servingpolicy"
# Every kind the operator writes, and what hangs off its Deployments.
KINDS = (
    "deployments",
    "services",
    "networkpolicies",
    "configmaps",
    "serviceaccounts",
    "roles",
    "rolebindings",
)
# The ServingPolicy's objects in apply order (the router's Role and RoleBinding are not
# kv_aware's).
CHILDREN = (
    ("deployment", ""),
    ("service", ""),
    ("networkpolicy", ""),
    ("configmap", "-policy"),
    ("serviceaccount", "-router"),
    ("deployment", "-router"),
    ("service", "-router"),
    ("networkpolicy", "-router"),
)
DELAY_S = 0.4


def _objects(kube: Kube, ns: str, name: str) -> dict[str, dict[str, Any]]:
    """Every object labelled as ServingPolicy `name`'s, by `kind/name`."""
    listed = kube.get(",".join(KINDS), "-n", ns, "-l", f"{POLICY_LABEL}={name}")
    return {
        f"{item['kind'].lower()}/{item['metadata']['name']}": item
        for item in (listed or {}).get("items", [])
    }


def _kill_when(
    kube: Kube,
    ns: str,
    name: str,
    start: Callable[..., HostOperator],
    make: Callable[[], object],
    kind: str,
    child: str,
) -> tuple[HostOperator, set[str]]:
    """Start an operator behind a slow link, `make()` the ServingPolicy and SIGKILL the
    operator as soon as `kind/child` exists; the link is cut with it. Returns the operator and
    the objects that existed then."""
    _, host, port = api_server_address(kube)
    link = SlowLink((host, port), DELAY_S)
    watch = Watch(kube, f"{kind}s", ns)
    try:
        operator = start(server=link.url)
        # The watch lists first: something listed means it is watching.
        watch.wait_line("the watch to list", lambda line: bool(line))
        make()
        watch.wait_line(f"{kind}/{child}", lambda line: line.endswith(f"/{child}"))
        operator.kill()
    finally:
        link.cut()
        watch.close()
    return operator, set(_objects(kube, ns, name))


def _assert_converged(kube: Kube, ns: str, name: str, wanted: set[str]) -> None:
    sp = kube.get("servingpolicy", name, "-n", ns)
    assert sp is not None
    uid = sp["metadata"]["uid"]
    objects = _objects(kube, ns, name)
    assert set(objects) == wanted
    for key, obj in objects.items():
        owners = [
            (o["kind"], o["uid"], o.get("controller")) for o in obj["metadata"]["ownerReferences"]
        ]
        assert owners == [("ServingPolicy", uid, True)], f"{key}: {owners}"
    # What hangs off the Deployments is owned too: each ReplicaSet by a Deployment that
    # exists, each pod by a ReplicaSet that exists.
    deployments = {o["metadata"]["uid"] for o in objects.values() if o["kind"] == "Deployment"}
    sets = (kube.get("replicasets", "-n", ns, "-l", f"{POLICY_LABEL}={name}") or {})["items"]
    replica_sets = {rs["metadata"]["uid"] for rs in sets}
    for rs in sets:
        (owner,) = rs["metadata"]["ownerReferences"]
        assert owner["uid"] in deployments, rs["metadata"]["name"]
    pods = (kube.get("pods", "-n", ns, "-l", f"{POLICY_LABEL}={name}") or {})["items"]
    for pod in pods:
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["uid"] in replica_sets, pod["metadata"]["name"]


def _wanted(name: str, router: bool) -> set[str]:
    return {f"{kind}/{name}{suffix}" for kind, suffix in CHILDREN if router or suffix != "-router"}


def test_killed_after_the_deployment_restarts_and_converges(
    kube: Kube,
    release: Release,
    make_policy: MakePolicy,
    own_operators: Callable[..., HostOperator],
) -> None:
    ns, name = release.namespace, "crash-deploy"
    _, at_kill = _kill_when(
        kube, ns, name, own_operators, lambda: make_policy(name, replicas=2), "deployment", name
    )
    print("at the kill:", sorted(at_kill))
    assert f"deployment/{name}" in at_kill
    assert f"deployment/{name}-router" not in at_kill, "the kill came too late"
    sp = kube.get("servingpolicy", name, "-n", ns)
    assert sp is not None and not sp.get("status")
    own_operators()

    def converged() -> dict[str, Any] | None:
        sp = reported(kube, ns, name)
        return sp if sp and condition(sp, "RouterReady").get("status") == "True" else None

    sp = wait_for("the report with RouterReady", converged)
    assert condition(sp, "Valid")["status"] == "True"
    assert sp["status"]["routingPolicy"] == "kv_aware"
    _assert_converged(kube, ns, name, _wanted(name, router=True))
    wait_for("two ready serving pods", lambda: len(ready_pods(kube, ns, name)) == 2)
    serving = kube.get("deployment", name, "-n", ns)
    assert serving is not None
    # Applied again after the restart, the same manifest changed nothing: no second rollout.
    assert serving["metadata"]["generation"] == 1
    sets = kube.get(
        "replicasets", "-n", ns, "-l", f"{POLICY_LABEL}={name},app.kubernetes.io/component=serving"
    )
    assert sets is not None and len(sets["items"]) == 1


def test_killed_mid_router_then_routing_dropped_leaves_nothing_behind(
    kube: Kube,
    release: Release,
    make_policy: MakePolicy,
    own_operators: Callable[..., HostOperator],
) -> None:
    """Killed after the router's ServiceAccount, before its Deployment; while the operator is
    down the spec drops to one replica (no router): the restarted operator follows the new
    generation and deletes the router children the first one left."""
    ns, name = release.namespace, "crash-router"
    _, at_kill = _kill_when(
        kube, ns, name, own_operators, lambda: make_policy(name, replicas=2),
        "serviceaccount", f"{name}-router",
    )  # fmt: skip
    print("at the kill:", sorted(at_kill))
    assert f"serviceaccount/{name}-router" in at_kill
    assert f"deployment/{name}-router" not in at_kill, "the kill came too late"
    patch(kube, ns, name, {"replicas": 1})
    own_operators()
    sp = wait_for("the report on generation 2", lambda: reported(kube, ns, name))
    assert sp["metadata"]["generation"] == 2
    assert sp["status"]["routingPolicy"] == "none"
    wait_for(
        "the router's ServiceAccount to go",
        lambda: kube.get("serviceaccount", f"{name}-router", "-n", ns) is None,
    )
    _assert_converged(kube, ns, name, _wanted(name, router=False))
    serving = kube.get("deployment", name, "-n", ns)
    assert serving is not None and serving["spec"]["replicas"] == 1
    wait_for("one ready serving pod", lambda: len(ready_pods(kube, ns, name)) == 1)
