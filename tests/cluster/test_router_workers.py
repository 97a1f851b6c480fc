"""A kv_aware router's workers follow the ready serving pods through a scale 2 → 4, a pod
failing and passing its readiness probe, a rolling restart and a scale to 1, on the real API
server with kwok's pods, and never name a pod that is not ready.

Every version of the pods and of the router Deployment is recorded from two watches. The API
server here stores everything in one etcd, whose revisions are the objects' resourceVersions,
so ordering both streams by resourceVersion gives the order the writes happened in: each
router version is checked against each pod's states before it was written.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest

from tests.cluster.helpers import (
    Kube,
    MakePolicy,
    RawWatch,
    Release,
    condition,
    patch,
    ready_pods,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow

SERVING_SELECTOR = "arcserving.io/servingpolicy={name},app.kubernetes.io/component=serving"
WORKER_URL = re.compile(r"^http://([0-9.]+):8000$")


def set_ready(kube: Kube, pod: dict[str, Any], ready: bool) -> None:
    """Write pod's Ready and ContainersReady conditions, as the kubelet does after a probe
    (kwok leaves them as written)."""
    conditions = [
        {**c, "status": str(ready)} if c["type"] in ("Ready", "ContainersReady") else c
        for c in pod["status"]["conditions"]
    ]
    kube.run(
        "patch", "pod", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"],
        "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"conditions": conditions}}),
    )  # fmt: skip


def is_ready(pod: dict[str, Any]) -> bool:
    """Ready as the operator counts it: not going away, an IP, condition Ready true."""
    status = pod.get("status") or {}
    return (
        not pod["metadata"].get("deletionTimestamp")
        and bool(status.get("podIP"))
        and any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        )
    )


def workers(deployment: dict[str, Any]) -> set[str]:
    """The worker IPs in a router Deployment's `--worker-urls`."""
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    if "--worker-urls" not in args:
        return set()
    urls = itertools.takewhile(
        lambda arg: not arg.startswith("--"), args[args.index("--worker-urls") + 1 :]
    )
    return {match[1] for url in urls if (match := WORKER_URL.match(url))}


def pod_histories(pod_events: list[dict[str, Any]]) -> dict[str, list[tuple[int, str, bool]]]:
    """Each pod's states, oldest first: (resourceVersion, IP, ready), after a state before its
    first event (version 0, not ready) for a pod the operator has not heard of yet."""
    histories: dict[str, list[tuple[int, str, bool]]] = {}
    for event in sorted(pod_events, key=resource_version):
        obj = event["object"]
        ip = (obj.get("status") or {}).get("podIP") or ""
        ready = event["type"] != "DELETED" and is_ready(obj)
        history = histories.setdefault(obj["metadata"]["name"], [(0, ip, False)])
        history.append((resource_version(event), ip, ready))
    return histories


def router_versions(router_events: list[dict[str, Any]]) -> list[tuple[int, frozenset[str]]]:
    """Each version of the router Deployment whose pod template changed: its resourceVersion
    and its worker IPs, oldest first."""
    versions, last_template = [], None
    for event in sorted(router_events, key=resource_version):
        template = event["object"]["spec"]["template"]
        if event["type"] != "DELETED" and template != last_template:
            versions.append((resource_version(event), frozenset(workers(event["object"]))))
            last_template = template
    return versions


def resource_version(event: dict[str, Any]) -> int:
    return int(event["object"]["metadata"]["resourceVersion"])


def test_router_workers_follow_scale_and_rolling_restart_and_name_only_ready_pods(
    kube: Kube, release: Release, make_policy: MakePolicy
) -> None:
    ns, name = release.namespace, "follow"
    make_policy(name, replicas=2, routing={"policy": "kv_aware"})

    def router_ready() -> dict[str, Any] | None:
        sp = reported(kube, ns, name)
        return sp if sp and condition(sp, "RouterReady").get("status") == "True" else None

    wait_for("RouterReady with two pods", router_ready)
    selector = SERVING_SELECTOR.format(name=name).replace("/", "%2F").replace(",", "%2C")
    pod_watch = RawWatch(kube, f"/api/v1/namespaces/{ns}/pods?watch=1&labelSelector={selector}")
    router_watch = RawWatch(
        kube,
        f"/apis/apps/v1/namespaces/{ns}/deployments?watch=1"
        f"&fieldSelector=metadata.name%3D{name}-router",
    )

    def router_workers() -> set[str]:
        router = kube.get("deployment", f"{name}-router", "-n", ns)
        return set() if router is None else workers(router)

    def settled(count: int) -> set[str] | None:
        """The router's workers once they are exactly the `count` ready pods."""
        ready = {p["status"]["podIP"] for p in ready_pods(kube, ns, name)}
        return ready if len(ready) == count and router_workers() == ready else None

    try:
        first = wait_for("the router on the 2 ready pods", lambda: settled(2))
        patch(kube, ns, name, {"replicas": 4})
        wait_for("the router on the 4 ready pods", lambda: settled(4), detail=router_workers)

        # A pod failing its readiness probe, then passing it again, as the kubelet reports it.
        failing = ready_pods(kube, ns, name)[0]
        set_ready(kube, failing, False)
        wait_for("the router on the 3 ready pods", lambda: settled(3), detail=router_workers)
        set_ready(kube, failing, True)
        wait_for("the router on the 4 ready pods again", lambda: settled(4), detail=router_workers)

        before_restart = {p["metadata"]["name"] for p in ready_pods(kube, ns, name)}
        kube.run("rollout", "restart", f"deployment/{name}", "-n", ns)

        def restarted() -> set[str] | None:
            names = {p["metadata"]["name"] for p in ready_pods(kube, ns, name)}
            return settled(4) if names and not names & before_restart else None

        wait_for("the router on 4 new pods", restarted, detail=router_workers)
        patch(kube, ns, name, {"replicas": 1})
        wait_for("the router on the 1 ready pod", lambda: settled(1), detail=router_workers)
    finally:
        pod_watch.close()
        router_watch.close()

    histories = pod_histories(pod_watch.events)
    versions = router_versions(router_watch.events)
    # The worker sets the router went through: the scale-up, the failing pod out and back, the
    # restart's pod swaps, the scale-down.
    assert len(versions) >= 6, versions
    assert versions[0][1] == first
    # The operator acts on its watch of the pods, a few events behind the API server, and kopf
    # handles each pod's events in order but different pods' side by side. So each router
    # version must list the ready pods of one view that holds each pod at one of its states
    # before the version was written, no older than the state the previous version's view
    # held: it names no pod that was not ready then, and never goes back to an older view of
    # a pod. (kwok gives a deleted pod's IP to a later pod, so a listed IP may be either's.)
    reached = dict.fromkeys(histories, 0)
    for version, listed in versions[1:]:
        candidates = {
            pod: [i for i, state in enumerate(history) if i >= reached[pod] and state[0] < version]
            for pod, history in histories.items()
        }
        view = {}
        for pod, states in candidates.items():
            # The pod's oldest state this version may show: not ready, or ready and listed.
            allowed = [
                i for i in states if not histories[pod][i][2] or histories[pod][i][1] in listed
            ]
            if not allowed:
                since = histories[pod][reached[pod] :]
                pytest.fail(
                    f"router version {version} ({sorted(listed)}) leaves out pod {pod}, ready "
                    f"at every one of its states since the previous version ({since})"
                )
            view[pod] = allowed[0]
        shown = {histories[pod][i][1] for pod, i in view.items() if histories[pod][i][2]}
        for ip in listed - shown:
            covering = [(pod, i) for pod, states in candidates.items() for i in states
                        if histories[pod][i][1:] == (ip, True)]  # fmt: skip
            if not covering:
                pytest.fail(
                    f"router version {version} lists {ip}, which no pod held ready before it: "
                    f"{histories}"
                )
            pod, i = covering[0]
            view[pod] = i
        reached.update(view)
