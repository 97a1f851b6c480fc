"""Operator faults against kmock's in-memory Kubernetes API, with the real kopf operator.

Injected: children deleted behind the operator's back (recreated by the deleted-child event
handler, with the drift timer parked for an hour so it cannot be what repairs them), and an
operator stopped while an update is half applied, then started again (one object of each
kind afterwards, the update finished, the status converged).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import kmock
import pytest

from arc_operator import PLURAL
from tests.faults.conftest import NO_TIMER_S
from tests.operator.conftest import (
    CONFIGMAPS,
    DEPLOYMENTS,
    NAMESPACE,
    NETWORKPOLICIES,
    SERVICES,
    SP_RESOURCE,
    creations,
    eventually,
    make_servingpolicy,
    make_spec,
    operator_applies,
    stored,
)

pytestmark = pytest.mark.asyncio

SP_PATH = f"/apis/arcserving.io/v1alpha1/namespaces/{NAMESPACE}/servingpolicies"
CHILDREN = [
    (DEPLOYMENTS, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments", "demo"),
    (SERVICES, f"/api/v1/namespaces/{NAMESPACE}/services", "demo"),
    (NETWORKPOLICIES, f"/apis/networking.k8s.io/v1/namespaces/{NAMESPACE}/networkpolicies", "demo"),
    (CONFIGMAPS, f"/api/v1/namespaces/{NAMESPACE}/configmaps", "demo-policy"),
]
# The bound on a recreation: far below the parked timer's hour, so a child back within it
# was recreated by the event handler, and far above an event round trip and a few API calls
# on any machine.
RECREATE_BOUND_S = NO_TIMER_S / 60
# The bound on the other waits, for a slow, busy machine; each ends as soon as what it waits
# for happens.
WAIT_S = 60.0
# Fields the API server (here the apply emulation in tests/operator/conftest.py) sets on each
# created object; the rest must come back equal.
SERVER_FIELDS = ("resourceVersion", "uid", "creationTimestamp", "generation")


async def create_sp(cluster, name: str, spec: dict[str, Any]) -> None:
    response = await cluster.post(SP_PATH, json=make_servingpolicy(name, spec))
    assert response.status == 200, await response.text()


async def merge_patch(cluster, path: str, body: dict[str, Any]) -> None:
    response = await cluster.patch(
        path, json=body, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert response.status == 200, await response.text()


def status_of(cluster, name: str) -> dict[str, Any]:
    return (stored(cluster, SP_RESOURCE, name) or {}).get("status") or {}


def valid(cluster, name: str) -> bool:
    return any(
        c["type"] == "Valid" and c["status"] == "True"
        for c in status_of(cluster, name).get("conditions", [])
    )


def owned(cluster, resource, uid: str) -> list[str]:
    """Names of the live objects of ``resource`` owned by the object with ``uid``."""
    return [
        key[2]
        for key, obj in list(cluster.objects.items())
        if key[0] == resource
        and not obj.deleted
        and any(ref["uid"] == uid for ref in obj.get("metadata", {}).get("ownerReferences", []))
    ]


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in SERVER_FIELDS}
    return {**obj, "metadata": meta}


async def wait_for_children(cluster) -> dict[Any, dict[str, Any]]:
    await eventually(lambda: valid(cluster, "demo"))
    return {
        resource: await eventually(lambda r=resource, n=name: stored(cluster, r, n))
        for resource, _, name in CHILDREN
    }


async def test_deleted_children_are_recreated_by_the_event_handler(
    cluster, slow_timer_operator
) -> None:
    await create_sp(cluster, "demo", make_spec(policy="ARC"))
    before = await wait_for_children(cluster)
    deletions = recreations = 0
    # Each child alone, then all of them at once.
    for batch in [[child] for child in CHILDREN] + [CHILDREN]:
        created = {resource: creations(cluster, resource, name) for resource, _, name in batch}
        started = time.monotonic()
        for _, path, name in batch:
            response = await cluster.delete(f"{path}/{name}")
            assert response.status == 200, await response.text()
            deletions += 1
        for resource, _, name in batch:
            back = await eventually(
                lambda r=resource, n=name: stored(cluster, r, n), timeout=RECREATE_BOUND_S
            )
            assert comparable(back) == comparable(before[resource])
            assert back["metadata"]["uid"] != before[resource]["metadata"]["uid"]
            assert creations(cluster, resource, name) == created[resource] + 1
            recreations += 1
        assert time.monotonic() - started < RECREATE_BOUND_S
    assert deletions == recreations == 2 * len(CHILDREN)
    for resource, _, name in CHILDREN:
        assert owned(cluster, resource, "uid-demo") == [name]


async def test_children_of_a_policy_being_deleted_are_not_recreated(
    cluster, slow_timer_operator
) -> None:
    await create_sp(cluster, "demo", make_spec())
    await wait_for_children(cluster)
    # Both passes the operator makes at start (the create handler's and the timer's first)
    # are done, so any apply after the deletion would be a repair.
    await eventually(lambda: len(operator_applies(cluster, DEPLOYMENTS)) >= 2)
    # Foreground deletion as the API server does it: the owner is marked and held by a
    # finalizer while the garbage collector deletes its children.
    await merge_patch(
        cluster,
        f"{SP_PATH}/demo",
        {
            "metadata": {
                "deletionTimestamp": "2026-01-01T00:00:00Z",
                "finalizers": ["foregroundDeletion"],
            }
        },
    )
    # The operator has handled the event of the mark: its owner index holds it.
    await eventually(
        lambda: any(
            e.body["metadata"].get("deletionTimestamp")
            for e in slow_timer_operator.events(PLURAL, "demo")
        ),
        timeout=RECREATE_BOUND_S,
    )
    applies = len(operator_applies(cluster, DEPLOYMENTS))
    response = await cluster.delete(f"{CHILDREN[0][1]}/demo")
    assert response.status == 200, await response.text()
    # The operator has handled the child's deletion (its repair handler ran and returned).
    await eventually(
        lambda: any(e.type == "DELETED" for e in slow_timer_operator.events("deployments", "demo")),
        timeout=RECREATE_BOUND_S,
    )
    assert stored(cluster, DEPLOYMENTS, "demo") is None
    assert len(operator_applies(cluster, DEPLOYMENTS)) == applies


async def test_operator_restart_mid_update_converges_without_duplicates(
    cluster, operator, caplog: pytest.LogCaptureFixture
) -> None:
    await create_sp(cluster, "demo", make_spec(policy="LRU", replicas=1, switchMode="Hot"))
    await wait_for_children(cluster)
    lru = stored(cluster, CONFIGMAPS, "demo-policy")
    held, answer, stopped = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def hold_configmap_write(request: kmock.Request) -> kmock.Response:
        """Until the operator has stopped, refuse its writes of the new ConfigMap (the
        update's last step): the first hangs until ``answer``, every one gets 503, as from a
        server going away. Other writes (the timer's applies of the old one) are answered as
        kmock does, 200 with the stored object (a reaction that answers nothing is disabled,
        and one that answers no status keeps the last one it gave).

        kmock stores a write before reactions run; a server that refused it has not written
        it, so the stored ConfigMap is put back first.
        """
        if stopped.is_set() or request.data["data"] == lru["data"]:
            return kmock.Response(status=200, payload=stored(cluster, CONFIGMAPS, "demo-policy"))
        cluster.objects[CONFIGMAPS, NAMESPACE, "demo-policy"] = lru
        held.set()
        await answer.wait()
        return kmock.Response(
            status=503, payload={"kind": "Status", "code": 503, "message": "server going away"}
        )

    cluster[CONFIGMAPS]["patch"] << hold_configmap_write
    await merge_patch(
        cluster,
        f"{SP_PATH}/demo",
        {
            "metadata": {"generation": 2, "resourceVersion": "2"},
            "spec": {"policy": "ARC", "replicas": 3, "routing": {"policy": "none"}},
        },
    )
    await asyncio.wait_for(held.wait(), WAIT_S)
    # Half applied: the Deployment has the new replicas, the ConfigMap still the old policy.
    assert stored(cluster, DEPLOYMENTS, "demo")["spec"]["replicas"] == 3
    assert json.loads(stored(cluster, CONFIGMAPS, "demo-policy")["data"]["policy.json"]) == {
        "policy": "lru"
    }
    # Stop the operator while its write hangs; answer the write once kopf says it stops.
    caplog.set_level(logging.INFO, logger="kopf")
    stopping = asyncio.create_task(operator.stop(graceful=True))
    await eventually(
        lambda: any("Operator is stopping" in r.getMessage() for r in caplog.records),
        timeout=WAIT_S,
    )
    answer.set()
    await stopping
    stopped.set()
    # No pass finished: the status still describes generation 1.
    assert status_of(cluster, "demo")["observedGeneration"] == 1

    await operator.start()
    await eventually(
        lambda: (
            json.loads(stored(cluster, CONFIGMAPS, "demo-policy")["data"]["policy.json"])
            == {"policy": "arc"}
        )
    )
    await eventually(lambda: status_of(cluster, "demo").get("observedGeneration") == 2)
    assert stored(cluster, DEPLOYMENTS, "demo")["spec"]["replicas"] == 3
    for resource, _, name in CHILDREN:
        assert owned(cluster, resource, "uid-demo") == [name]
        assert creations(cluster, resource, name) == 1
    assert valid(cluster, "demo")
