"""Fixtures for the operator tests: kmock's in-memory Kubernetes API, a real /metrics
server on 127.0.0.1, and the real kopf operator running in-process against them."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
import kopf
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from arc_operator import GROUP, KIND, PLURAL, VERSION
from arc_operator.handlers import CHILD_KINDS, POD_KIND, SERVING_POD_LABELS, register
from arc_operator.metrics import POLICY_INFO
from arc_operator.models import OperatorConfig

NAMESPACE = "serving"
SP_RESOURCE = kmock.resource(GROUP, VERSION, PLURAL)
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
SERVICES = kmock.resource("", "v1", "services")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
NETWORKPOLICIES = kmock.resource("networking.k8s.io", "v1", "networkpolicies")
PODS = kmock.resource("", "v1", "pods")
EVENTS = kmock.resource("", "v1", "events")
SERVICEACCOUNTS = kmock.resource("", "v1", "serviceaccounts")
ROLES = kmock.resource("rbac.authorization.k8s.io", "v1", "roles")
ROLEBINDINGS = kmock.resource("rbac.authorization.k8s.io", "v1", "rolebindings")
BUDGETS = kmock.resource("policy", "v1", "poddisruptionbudgets")
# Fast timer for tests; the default (30 s) is what clusters use.
STATUS_INTERVAL_S = 0.3
# The peers the operator admits to the serving pods, as the chart configures them.
SERVING_PEERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
]
# The metrics scrapers (Prometheus and the operator) the operator admits to /metrics.
MONITORING_PEERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "arc-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
    }
]
ROUTER_IMAGE = "ghcr.io/arc-serving/router:0.1.0"


def make_spec(**overrides: Any) -> dict[str, Any]:
    """A valid ServingPolicy spec (CPU-sized), with top-level fields replaced."""
    spec: dict[str, Any] = {
        "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "servedName": "qwen"},
        "image": "ghcr.io/arc-serving/vllm:0.1.0",
        "replicas": 1,
        "policy": "LRU",
        "switchMode": "Hot",
        "cache": {"blockSize": 16, "numBlocks": 512},
        "maxModelLen": 4096,
        "resources": {"gpus": 1, "cpu": "4", "memory": "16Gi"},
        # The API is closed by default: every valid spec names its key's Secret.
        "apiKeySecretRef": {"name": "qwen-api-key"},
    }
    spec.update(overrides)
    return spec


def make_servingpolicy(name: str, spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    """A ServingPolicy as the API server would store it (uid and generation set)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "generation": generation,
            # kopf's timer patches test resourceVersion (optimistic locking); kmock keeps
            # what it is given, so the test sets it as the API server would.
            "resourceVersion": str(generation),
        },
        "spec": spec,
    }


def metrics_text(policy: str | None, hits: float, queries: float) -> str:
    """A real Prometheus exposition of what a vLLM pod with the plugin shows."""
    registry = CollectorRegistry()
    labels = {"model_name": "qwen", "engine": "0"}
    Counter("vllm:prefix_cache_hits", "hits", list(labels), registry=registry).labels(**labels).inc(
        hits
    )
    Counter("vllm:prefix_cache_queries", "queries", list(labels), registry=registry).labels(
        **labels
    ).inc(queries)
    info = Gauge(POLICY_INFO, "active policy", ["policy"], registry=registry)
    if policy is not None:
        info.labels(policy=policy).set(1)
    return generate_latest(registry).decode()


class PodMetricsServer:
    """A /metrics endpoint on 127.0.0.1 standing in for every pod (all pods use one port).

    It serves ``text``, or, after ``serve_traffic``, counters that grow by a fixed step at
    every scrape, as a pod under steady load shows.
    """

    def __init__(self) -> None:
        self.text = metrics_text("lru", 0, 0)
        self.port = 0
        self.scrapes = 0
        self._traffic: tuple[str, float, float] | None = None
        self._counts = (0.0, 0.0)

    def serve_traffic(self, policy: str, hits: float, queries: float) -> None:
        """From now on each scrape adds ``hits`` of ``queries`` to the counters."""
        self._traffic = (policy, hits, queries)

    async def handle(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self._traffic is not None:
            policy, hits, queries = self._traffic
            self._counts = (self._counts[0] + hits, self._counts[1] + queries)
            self.text = metrics_text(policy, *self._counts)
        return web.Response(text=self.text, content_type="text/plain")


@pytest_asyncio.fixture
async def pod_metrics() -> AsyncIterator[PodMetricsServer]:
    server = PodMetricsServer()
    app = web.Application()
    app.router.add_get("/metrics", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.port = runner.addresses[0][1]
    yield server
    await runner.cleanup()


@pytest.fixture
def cluster(kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """kmock serving the kinds the operator uses, and a kubeconfig pointing at it."""
    kmock.resources[SP_RESOURCE] = kmock.ResourceInfo(
        kind=KIND,
        singular="servingpolicy",
        namespaced=True,
        verbs={"get", "list", "watch", "patch"},
        shortnames={"sp"},
        subresources={"status"},
    )
    for resource, kind in [
        (DEPLOYMENTS, "Deployment"),
        (SERVICES, "Service"),
        (CONFIGMAPS, "ConfigMap"),
        (NETWORKPOLICIES, "NetworkPolicy"),
        (PODS, "Pod"),
        (EVENTS, "Event"),
        (SERVICEACCOUNTS, "ServiceAccount"),
        (ROLES, "Role"),
        (ROLEBINDINGS, "RoleBinding"),
        (BUDGETS, "PodDisruptionBudget"),
    ]:
        kmock.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"},
        )
    # kopf waits for these to be discoverable, as they are in every real cluster.
    kmock.resources[kmock.resource("", "v1", "namespaces")] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs={"get", "list", "watch"}
    )
    crds = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    kmock.resources[crds] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"}
    )
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kmock",
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "test-token"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(type(kmock), "_render_error", _refuse_failed_patch_tests)
    monkeypatch.setattr(type(kmock), "_handle", _create_on_apply)
    return kmock


_render_error = kmock.KubernetesEmulator._render_error
_handle = kmock.KubernetesEmulator._handle
APPLY_PATCH = "application/apply-patch+yaml"


def is_apply(request: Any) -> bool:
    """Whether ``request`` is a server-side apply (PATCH of application/apply-patch+yaml)."""
    content_type = request.headers.get("Content-Type", "")
    return request.method.value == "PATCH" and content_type.startswith(APPLY_PATCH)


async def _create_on_apply(self: kmock.KubernetesEmulator, request: Any) -> web.StreamResponse:
    """A server-side apply of an object that does not exist creates it, with a fresh uid and
    creationTimestamp, as the API server does; kmock 0.8 answers 404. An apply of an existing
    object goes on to kmock's patch (a recursive merge of the applied fields)."""
    if is_apply(request) and request.resource is not None and request.name is not None:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                created = copy.deepcopy(request.data)
                created["metadata"].update(
                    uid=str(uuid.uuid4()),
                    creationTimestamp=datetime.datetime.now(tz=datetime.UTC).isoformat(),
                )
                if key in self.objects:
                    self.objects[key].create(created)
                else:
                    self.objects[key] = created
                raw = self.objects[key].raw
                await self._buses[request.resource].put({"type": "ADDED", "object": raw})
    return await _handle(self, request)


async def _refuse_failed_patch_tests(
    self: kmock.KubernetesEmulator, exc: Exception
) -> web.StreamResponse:
    """A JSON patch whose ``test`` op fails gets 422, as from the API server; kmock 0.8 answers
    500. kopf tests the resourceVersion when it patches: on 422 it takes the object's newer
    version and tries again, on 500 it retries the stale patch 9 times with backoff (a spec
    edit that raced an operator write then stalled the operator past the tests' 10 s waits)."""
    if isinstance(exc, jsonpatch.JsonPatchTestFailed):
        exc = kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
    return await _render_error(self, exc)


@dataclass(frozen=True, slots=True)
class HandledEvent:
    """A watch event the operator has finished handling (see ``RunningOperator.handled``)."""

    plural: str
    type: str | None  # ADDED, MODIFIED, DELETED; None for an object of the initial listing
    name: str
    body: dict[str, Any]


class RunningOperator:
    """The real kopf operator with arc-serving's handlers, in its own thread and loop.

    kopf owns its event loop (at exit it cancels every task left in it), so it cannot
    share the test's loop, where kmock and the /metrics server run.

    ``handled`` lists every watch event of the kinds the operator watches (ServingPolicies,
    its children, the serving pods) once the operator has handled it: for each event kopf
    updates its indexes, then runs the event's ``on.event`` handlers one after another in
    the order they were registered, and a recording handler is registered after
    arc-serving's. A test that must show that an event changed nothing waits for the event
    here instead of sleeping.
    """

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # kopf's stop flag
        self._cancel = threading.Event()
        # The operator-wide memo of the current run (handlers keep their Runtime in it).
        self.memo = kopf.Memo()
        self.handled: list[HandledEvent] = []

    def _run(self, ready: threading.Event) -> None:
        registry = kopf.OperatorRegistry()
        register(registry, self.config)
        self._record_events(registry)
        asyncio.run(self._operate(registry, ready))

    def _record_events(self, registry: kopf.OperatorRegistry) -> None:
        # The operator's settings give each of these watches its server-side selector.
        kinds = [(GROUP, VERSION, PLURAL, None), *[(*kind, None) for kind in CHILD_KINDS],
                 (*POD_KIND, SERVING_POD_LABELS)]  # fmt: skip
        for group, version, plural, labels in kinds:

            @kopf.on.event(group, version, plural, id=f"test_record_{plural}", labels=labels,
                           registry=registry)  # fmt: skip
            async def record(
                event: kopf.RawEvent, body: kopf.Body, _plural: str = plural, **_: Any
            ) -> None:
                self.handled.append(HandledEvent(_plural, event["type"], body["metadata"]["name"],
                                                 copy.deepcopy(dict(body))))  # fmt: skip

    def events(self, plural: str, name: str) -> list[HandledEvent]:
        """The handled events of object ``name`` of ``plural``, oldest first."""
        return [e for e in list(self.handled) if e.plural == plural and e.name == name]

    async def _operate(self, registry: kopf.OperatorRegistry, ready: threading.Event) -> None:
        cancelled = asyncio.ensure_future(asyncio.to_thread(self._cancel.wait))
        operating = asyncio.ensure_future(
            kopf.operator(
                registry=registry,
                settings=kopf.OperatorSettings(),
                clusterwide=True,
                stop_flag=self._stop,
                ready_flag=ready,
                memo=self.memo,
            )
        )
        try:
            await asyncio.wait([cancelled, operating], return_when=asyncio.FIRST_COMPLETED)
            operating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await operating
        finally:
            # End the threads that wait on either flag (this one's, and kopf's for its stop
            # flag): asyncio.run joins them.
            self._cancel.set()
            self._stop.set()
            await cancelled
            # Close the operator's sessions in their own loop whatever kopf's shutdown did
            # (closing twice is harmless): a connection a stop leaves open is otherwise
            # finalised by some later test's garbage collection, failing that test on its
            # ResourceWarning.
            runtime = self.memo.get("runtime")
            if runtime is not None:
                await runtime.api.close()
                await runtime.http.close()

    async def start(self) -> None:
        self._stop, self._cancel = threading.Event(), threading.Event()
        self.memo = kopf.Memo()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert await asyncio.to_thread(ready.wait, 60), "kopf did not start within 60 s"

    async def stop(self, graceful: bool = False) -> None:
        """Stop the operator: ``graceful`` by kopf's stop flag, as a SIGTERM stops the
        deployed one, else by cancelling it. A graceful stop waits up to 5 s for a status
        timer whose patch was in flight: kopf closes its API session under the patch, and
        the timer then waits for new credentials until kopf cancels it."""
        if self._thread is not None:
            (self._stop if graceful else self._cancel).set()
            await asyncio.to_thread(self._thread.join, 60)
            assert not self._thread.is_alive(), "kopf did not stop within 60 s"
            self._thread = None


@pytest_asyncio.fixture
async def operator(cluster, pod_metrics: PodMetricsServer) -> AsyncIterator[RunningOperator]:
    running = RunningOperator(
        OperatorConfig.model_validate(
            {
                "metrics_port": pod_metrics.port,
                "status_interval": STATUS_INTERVAL_S,
                "serving_peers": SERVING_PEERS,
                "monitoring_peers": MONITORING_PEERS,
                "router_image": ROUTER_IMAGE,
            }
        )
    )
    await running.start()
    yield running
    await running.stop()


async def eventually(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll ``check`` until it returns a truthy value; fail after ``timeout`` seconds (a
    bound for a slow, busy machine: the poll returns as soon as the check holds)."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (KeyError, AssertionError) as error:
            last_error = error
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s (last error: {last_error!r})")


def stored(kube: kmock.KubernetesEmulator, resource: Any, name: str) -> dict[str, Any] | None:
    """The current stored object, or None if absent or deleted."""
    key = (resource, NAMESPACE, name)
    if key not in kube.objects or kube.objects[key].deleted:
        return None
    return copy.deepcopy(dict(kube.objects[key].raw))


def creations(kube: kmock.KubernetesEmulator, resource: Any, name: str) -> int:
    """How many times the object was created: the distinct uids in its history."""
    history = kube.objects[resource, NAMESPACE, name].history
    return len({version["metadata"]["uid"] for version in history if version is not None})


def operator_applies(cluster, resource: Any) -> list[Any]:
    """The operator's server-side applies of ``resource``, oldest first."""
    return [
        request
        for request in list(cluster)
        if request.resource == resource
        and is_apply(request)
        and "kmock" not in request.headers.get("User-Agent", "")
    ]


def operator_writes(cluster, resource: Any, method: str) -> int:
    """Requests of ``method`` on ``resource`` made by the operator (not by the test)."""
    return sum(
        1
        for request in list(cluster)
        if request.resource == resource
        and request.method.value == method
        and "kmock" not in request.headers.get("User-Agent", "")
    )


SP_PATH = f"/apis/arcserving.io/v1alpha1/namespaces/{NAMESPACE}/servingpolicies"


async def create_sp(cluster, name: str, spec: dict[str, Any]) -> None:
    response = await cluster.post(SP_PATH, json=make_servingpolicy(name, spec))
    assert response.status == 200, await response.text()


async def edit_spec(cluster, name: str, generation: int, **changes: Any) -> None:
    """A spec edit as the API server records it: new spec fields and a new generation."""
    response = await cluster.patch(
        f"{SP_PATH}/{name}",
        json={
            "metadata": {"generation": generation, "resourceVersion": str(generation)},
            "spec": changes,
        },
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()


async def create_pod(cluster, owner: str, pod: str, ip: str, ready: bool = True) -> None:
    """A serving pod of ServingPolicy ``owner`` as the Deployment controller and the kubelet
    leave it: the template's labels, an IP, and its Ready condition."""
    template = stored(cluster, DEPLOYMENTS, owner)["spec"]["template"]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": NAMESPACE, "labels": template["metadata"]["labels"]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
    response = await cluster.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=body)
    assert response.status == 200, await response.text()


def operator_deletes(cluster, resource: Any) -> list[str]:
    """The names of the objects of ``resource`` the operator asked to delete, oldest first."""
    return [
        request.name
        for request in list(cluster)
        if request.resource == resource
        and request.method.value == "DELETE"
        and "kmock" not in request.headers.get("User-Agent", "")
    ]


def status_of(cluster, name: str) -> dict[str, Any]:
    return (stored(cluster, SP_RESOURCE, name) or {}).get("status") or {}


def condition(cluster, name: str, type_: str) -> dict[str, Any]:
    found = [c for c in status_of(cluster, name).get("conditions", []) if c["type"] == type_]
    return found[0] if found else {}
