"""Routing with the real kopf operator against kmock's in-memory Kubernetes API.

The test plays the controllers and the kubelet: it creates serving pods with the serving
template's labels, marks them ready or not, deletes them, and sets the router Deployment's
rollout status; the operator does the rest (docs/architecture.md, "Routing").
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from vllm_router.launch_router import parse_router_args

from arc_operator.handlers import SERVING_POD_SELECTOR
from arc_operator.models import OperatorConfig
from tests.operator.conftest import (
    DEPLOYMENTS,
    MONITORING_PEERS,
    NAMESPACE,
    NETWORKPOLICIES,
    PODS,
    ROLEBINDINGS,
    ROLES,
    ROUTER_IMAGE,
    SERVICEACCOUNTS,
    SERVICES,
    SERVING_PEERS,
    PodMetricsServer,
    RunningOperator,
    condition,
    create_pod,
    create_sp,
    edit_spec,
    eventually,
    make_spec,
    operator_applies,
    operator_deletes,
    status_of,
    stored,
)

pytestmark = pytest.mark.asyncio

ROUTER_KINDS = [DEPLOYMENTS, SERVICES, NETWORKPOLICIES, SERVICEACCOUNTS, ROLES, ROLEBINDINGS]
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"


@pytest_asyncio.fixture
async def events_only_operator(cluster, pod_metrics) -> AsyncIterator[RunningOperator]:
    """The operator whose timer fires once at start and not again within a test: whatever
    changes afterwards came from a watch event."""
    running = RunningOperator(
        OperatorConfig(
            metrics_port=pod_metrics.port,
            status_interval=3600.0,
            serving_peers=SERVING_PEERS,
            monitoring_peers=MONITORING_PEERS,
            router_image=ROUTER_IMAGE,
        )
    )
    await running.start()
    yield running
    await running.stop()


@pytest_asyncio.fixture
async def second_pod_metrics(pod_metrics) -> AsyncIterator[PodMetricsServer]:
    """Another pod's /metrics, at 127.0.0.2 on the port the operator scrapes every pod at."""
    server = PodMetricsServer()
    app = web.Application()
    app.router.add_get("/metrics", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.2", pod_metrics.port).start()
    server.port = pod_metrics.port
    yield server
    await runner.cleanup()


async def merge_patch(cluster, path: str, body: dict[str, Any]) -> None:
    response = await cluster.patch(
        path, json=body, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert response.status == 200, await response.text()


async def set_ready(cluster, pod: str, ready: bool) -> None:
    """The kubelet's verdict on the pod's readiness probe."""
    status = "True" if ready else "False"
    await merge_patch(
        cluster,
        f"{PODS_PATH}/{pod}",
        {"status": {"conditions": [{"type": "Ready", "status": status}]}},
    )


async def delete_pod(cluster, pod: str) -> None:
    """A pod going away as in a rolling update: first marked for deletion, then gone."""
    await merge_patch(
        cluster, f"{PODS_PATH}/{pod}", {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}
    )
    # kmock, like the API server, removes a marked object that has no finalizer at once.
    if stored(cluster, PODS, pod) is not None:
        response = await cluster.delete(f"{PODS_PATH}/{pod}")
        assert response.status == 200, await response.text()
    assert stored(cluster, PODS, pod) is None


def router_deployment(cluster) -> dict[str, Any]:
    return stored(cluster, DEPLOYMENTS, "demo-router") or {}


def router_args(cluster) -> Any:
    (container,) = router_deployment(cluster)["spec"]["template"]["spec"]["containers"]
    return parse_router_args(container["args"])


def workers(cluster) -> list[str]:
    """The router's static workers, checked against their KV event sources."""
    args = router_args(cluster)
    sources = [source.split("=")[0] for source in args.kv_event_source]
    assert sources == args.worker_urls == [r.split("=")[0] for r in args.kv_event_replay_source]
    return list(args.worker_urls)


def url(ip: str) -> str:
    return f"http://{ip}:8000"


async def test_kv_aware_router_follows_the_ready_serving_pods(
    cluster, events_only_operator
) -> None:
    # Three replicas and no routing named: kv_aware, the fleet default.
    await create_sp(cluster, "demo", make_spec(replicas=3))
    await eventually(lambda: router_deployment(cluster))
    # No serving pod is ready: no worker, no router pod.
    assert router_deployment(cluster)["spec"]["replicas"] == 0
    assert workers(cluster) == []
    reason = await eventually(lambda: condition(cluster, "demo", "RouterReady").get("reason"))
    assert reason == "NoReadyServingPods"
    assert status_of(cluster, "demo")["routingPolicy"] == "kv_aware"

    await create_pod(cluster, "demo", "demo-b", "127.0.0.2")
    await eventually(lambda: workers(cluster) == [url("127.0.0.2")])
    assert router_deployment(cluster)["spec"]["replicas"] == 1
    args = router_args(cluster)
    assert args.kv_event_source == ["http://127.0.0.2:8000=tcp://127.0.0.2:5557"]
    assert args.kv_event_replay_source == ["http://127.0.0.2:8000=tcp://127.0.0.2:5558"]
    assert (args.kv_event_block_size, args.kv_event_model) == (16, "qwen")

    # A pod starting up joins once its readiness probe passes; the order is by pod name.
    await create_pod(cluster, "demo", "demo-a", "127.0.0.3", ready=False)
    await set_ready(cluster, "demo-a", True)
    await eventually(lambda: workers(cluster) == [url("127.0.0.3"), url("127.0.0.2")])
    # Scale up.
    await create_pod(cluster, "demo", "demo-c", "127.0.0.4")
    want = [url("127.0.0.3"), url("127.0.0.2"), url("127.0.0.4")]
    await eventually(lambda: workers(cluster) == want)
    # A pod failing its readiness probe leaves; back, it returns.
    await set_ready(cluster, "demo-b", False)
    await eventually(lambda: workers(cluster) == [url("127.0.0.3"), url("127.0.0.4")])
    await set_ready(cluster, "demo-b", True)
    await eventually(lambda: workers(cluster) == want)
    # Scale down.
    await delete_pod(cluster, "demo-a")
    await eventually(lambda: workers(cluster) == [url("127.0.0.2"), url("127.0.0.4")])
    # A rolling restart: each new pod ready before an old one goes.
    b, c, d, e = (url(f"127.0.0.{host}") for host in (2, 4, 5, 6))
    await create_pod(cluster, "demo", "demo-d", "127.0.0.5")
    await eventually(lambda: workers(cluster) == [b, c, d])
    await delete_pod(cluster, "demo-b")
    await eventually(lambda: workers(cluster) == [c, d])
    await create_pod(cluster, "demo", "demo-e", "127.0.0.6")
    await eventually(lambda: workers(cluster) == [c, d, e])
    await delete_pod(cluster, "demo-c")
    await eventually(lambda: workers(cluster) == [d, e])
    rolling = router_deployment(cluster)["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxUnavailable": 0, "maxSurge": 1}
    # Every serving pod gone: the router has no worker left and no pod.
    await delete_pod(cluster, "demo-d")
    await delete_pod(cluster, "demo-e")
    await eventually(lambda: router_deployment(cluster)["spec"]["replicas"] == 0)
    assert workers(cluster) == []


def follows(caplog: pytest.LogCaptureFixture) -> int:
    """How many times the pod watch re-applied the router Deployment (the operator logs it)."""
    return sum("router of demo routes to" in record.getMessage() for record in caplog.records)


async def test_a_pod_event_that_leaves_the_ready_set_alone_applies_nothing(
    cluster, events_only_operator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    await create_sp(cluster, "demo", make_spec(replicas=2))
    await eventually(lambda: router_deployment(cluster))
    await create_pod(cluster, "demo", "demo-a", "127.0.0.2")
    await eventually(lambda: workers(cluster) == [url("127.0.0.2")])
    await eventually(lambda: follows(caplog) == 1)
    # A pod starting up (not ready yet) and an annotation change leave the workers alone.
    await create_pod(cluster, "demo", "demo-b", "127.0.0.3", ready=False)
    await merge_patch(cluster, f"{PODS_PATH}/demo-a", {"metadata": {"annotations": {"x": "y"}}})
    # The operator has handled both events: the new pod's and the annotation's.
    await eventually(lambda: events_only_operator.events("pods", "demo-b"))
    await eventually(
        lambda: any(
            (e.body["metadata"].get("annotations") or {}).get("x") == "y"
            for e in events_only_operator.events("pods", "demo-a")
        )
    )
    assert follows(caplog) == 1
    await set_ready(cluster, "demo-b", True)
    await eventually(lambda: workers(cluster) == [url("127.0.0.2"), url("127.0.0.3")])
    assert follows(caplog) <= 2  # this change, unless a (kmock-repeated) create pass had it first


async def test_pods_are_watched_with_a_server_side_selector_for_serving_pods(
    cluster, operator
) -> None:
    await create_sp(cluster, "demo", make_spec())
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    selectors = {
        request.params.get("labelSelector", "")
        for request in list(cluster)
        if request.resource is not None
        and request.resource.plural == "pods"
        and request.action is not None
        and request.action.value.lower() == "watch"
        and "kmock" not in request.headers.get("User-Agent", "")
    }
    assert selectors == {SERVING_POD_SELECTOR}
    serving = stored(cluster, DEPLOYMENTS, "demo")["spec"]["template"]["metadata"]["labels"]
    assert dict(pair.split("=") for pair in SERVING_POD_SELECTOR.split(",")).items() <= (
        serving.items()
    )


def serving_applies(cluster) -> list[Any]:
    """The operator's applies of the serving Deployment ``demo``."""
    return [request for request in operator_applies(cluster, DEPLOYMENTS) if request.name == "demo"]


def engine_args(cluster) -> list[str]:
    (container,) = stored(cluster, DEPLOYMENTS, "demo")["spec"]["template"]["spec"]["containers"]
    return container["args"]


def serving_ingress_ports(cluster) -> list[list[int]]:
    policy = stored(cluster, NETWORKPOLICIES, "demo")
    return [[port["port"] for port in rule["ports"]] for rule in policy["spec"]["ingress"]]


async def test_switching_routing_policy_adds_changes_and_removes_the_router(
    cluster, operator
) -> None:
    await create_sp(cluster, "demo", make_spec(replicas=2, routing={"policy": "none"}))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await create_pod(cluster, "demo", "demo-a", "127.0.0.2")
    await create_pod(cluster, "demo", "demo-b", "127.0.0.3")
    await eventually(lambda: status_of(cluster, "demo").get("routingPolicy") == "none")
    assert not condition(cluster, "demo", "RouterReady")
    assert all(stored(cluster, kind, "demo-router") is None for kind in ROUTER_KINDS)
    assert "--kv-events-config" not in engine_args(cluster)

    # none -> kv_aware: static workers, KV events on the serving pods, no API access.
    await edit_spec(cluster, "demo", 2, routing={"policy": "kv_aware"})
    await eventually(lambda: workers(cluster) == [url("127.0.0.2"), url("127.0.0.3")])
    await eventually(lambda: "--kv-events-config" in engine_args(cluster))
    assert stored(cluster, SERVICEACCOUNTS, "demo-router")["automountServiceAccountToken"] is False
    assert stored(cluster, ROLES, "demo-router") is None
    service = await eventually(lambda: stored(cluster, SERVICES, "demo-router"))
    assert (
        service["spec"]["selector"] == router_deployment(cluster)["spec"]["selector"]["matchLabels"]
    )
    await eventually(lambda: serving_ingress_ports(cluster) == [[8000], [5557, 5558]])
    await eventually(lambda: status_of(cluster, "demo").get("routingPolicy") == "kv_aware")
    await eventually(lambda: condition(cluster, "demo", "RouterReady"))

    # kv_aware -> round_robin: service discovery with a Role; no KV events.
    await edit_spec(cluster, "demo", 3, routing={"policy": "round_robin"})
    await eventually(lambda: stored(cluster, ROLEBINDINGS, "demo-router"))
    await eventually(lambda: router_args(cluster).policy == "round_robin")
    args = router_args(cluster)
    assert args.service_discovery and args.worker_urls == []
    assert stored(cluster, ROLES, "demo-router")["rules"][0]["verbs"] == ["get", "list", "watch"]
    assert stored(cluster, SERVICEACCOUNTS, "demo-router")["automountServiceAccountToken"] is True
    await eventually(lambda: "--kv-events-config" not in engine_args(cluster))
    await eventually(lambda: serving_ingress_ports(cluster) == [[8000]])
    await eventually(lambda: status_of(cluster, "demo").get("routingPolicy") == "round_robin")

    # round_robin -> none: every router child is deleted; clients reach the pods again.
    await edit_spec(cluster, "demo", 4, routing={"policy": "none"})
    await eventually(
        lambda: all(stored(cluster, kind, "demo-router") is None for kind in ROUTER_KINDS)
    )
    await eventually(lambda: status_of(cluster, "demo").get("routingPolicy") == "none")
    await eventually(lambda: not condition(cluster, "demo", "RouterReady"))
    policy = stored(cluster, NETWORKPOLICIES, "demo")
    assert policy["spec"]["ingress"][0]["from"] == SERVING_PEERS + MONITORING_PEERS
    for kind in ROUTER_KINDS:
        assert "demo-router" in operator_deletes(cluster, kind)
    # The serving children stay: the operator deleted nothing else.
    assert all(name == "demo-router" for k in ROUTER_KINDS for name in operator_deletes(cluster, k))
    # And the deletions hold: the timer's next passes recreate nothing. Each pass applies the
    # serving Deployment; three more applies of it mean two whole passes at least.
    passes = len(serving_applies(cluster))
    await eventually(lambda: len(serving_applies(cluster)) >= passes + 3)
    assert all(stored(cluster, kind, "demo-router") is None for kind in ROUTER_KINDS)


async def test_router_ready_and_per_replica_hit_rates_in_status(
    cluster, operator, pod_metrics, second_pod_metrics
) -> None:
    # Pod a hits 3 of 4 prompt tokens per interval, pod b 1 of 4.
    pod_metrics.serve_traffic("arc", hits=300, queries=400)
    second_pod_metrics.serve_traffic("arc", hits=100, queries=400)
    await create_sp(cluster, "demo", make_spec(policy="ARC", replicas=2))
    await eventually(lambda: stored(cluster, DEPLOYMENTS, "demo"))
    await create_pod(cluster, "demo", "demo-a", "127.0.0.1")
    await create_pod(cluster, "demo", "demo-b", "127.0.0.2")
    ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    await merge_patch(
        cluster, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/demo", {"status": ready}
    )
    await eventually(lambda: router_deployment(cluster).get("spec", {}).get("replicas") == 1)
    # The serving pods are ready, the router is not yet: Ready says so.
    router = await eventually(
        lambda: (
            condition(cluster, "demo", "RouterReady").get("reason") == "RolloutInProgress"
            and condition(cluster, "demo", "RouterReady")
        )
    )
    assert router["status"] == "False" and "router pods" in router["message"]
    await eventually(
        lambda: condition(cluster, "demo", "Ready").get("reason") == "RolloutInProgress"
    )
    assert condition(cluster, "demo", "PolicyApplied")["status"] == "True"

    one = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    await merge_patch(
        cluster, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/demo-router", {"status": one}
    )
    await eventually(lambda: condition(cluster, "demo", "RouterReady").get("status") == "True")
    await eventually(lambda: condition(cluster, "demo", "Ready").get("status") == "True")
    status = status_of(cluster, "demo")
    assert (status["phase"], status["routingPolicy"]) == ("Ready", "kv_aware")
    assert condition(cluster, "demo", "RouterReady")["reason"] == "RouterReady"
    await eventually(
        lambda: (
            status_of(cluster, "demo").get("replicaHitRates")
            == [{"pod": "demo-a", "hitRate": 0.75}, {"pod": "demo-b", "hitRate": 0.25}]
        )
    )
    await eventually(lambda: status_of(cluster, "demo").get("hitRate") == pytest.approx(0.5))


async def test_invalid_routing_is_reported_and_changes_nothing(cluster, operator) -> None:
    await create_sp(cluster, "demo", make_spec(replicas=2, routing={"policy": "round_robin"}))
    await eventually(lambda: stored(cluster, ROLEBINDINGS, "demo-router"))
    await eventually(lambda: condition(cluster, "demo", "Valid").get("status") == "True")
    before = {kind: stored(cluster, kind, "demo-router") for kind in ROUTER_KINDS}
    serving = stored(cluster, DEPLOYMENTS, "demo")

    await edit_spec(cluster, "demo", 2, routing={"policy": "kv_aware", "args": ["--port", "1"]})
    valid = await eventually(
        lambda: (
            condition(cluster, "demo", "Valid").get("status") == "False"
            and condition(cluster, "demo", "Valid")
        )
    )
    assert valid["reason"] == "InvalidSpec"
    assert "routing.args may not set --port" in valid["message"]
    assert status_of(cluster, "demo").get("routingPolicy") is None
    for kind in ROUTER_KINDS:
        assert stored(cluster, kind, "demo-router") == before[kind]
    assert stored(cluster, DEPLOYMENTS, "demo") == serving


async def test_routing_without_a_router_image_is_refused_naming_the_setting(
    cluster, pod_metrics
) -> None:
    running = RunningOperator(OperatorConfig(metrics_port=pod_metrics.port, status_interval=0.3))
    await running.start()
    try:
        await create_sp(cluster, "demo", make_spec(replicas=2))
        valid = await eventually(
            lambda: (
                condition(cluster, "demo", "Valid").get("status") == "False"
                and condition(cluster, "demo", "Valid")
            )
        )
        assert "spec.routing.image" in valid["message"]
        assert "ARC_OPERATOR_ROUTER_IMAGE" in valid["message"]
        # Nothing was applied, not even the serving children.
        assert stored(cluster, DEPLOYMENTS, "demo") is None
        assert stored(cluster, DEPLOYMENTS, "demo-router") is None
    finally:
        await running.stop()
