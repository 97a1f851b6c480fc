"""kopf handlers for the ServingPolicy kind (run: ``kopf run -m arc_operator.handlers``).

Create, update (of ``spec``), resume and the status timer all call one ``reconcile``:

1. validate the spec (``models.parse_spec``); an invalid spec touches no child;
2. apply the children (Deployment, Service, NetworkPolicy, ConfigMap from ``manifests``; the
   NetworkPolicy admits the operator's configured peers; with routing, the router's children,
   its Deployment built from the ready serving pods), each owned by the ServingPolicy via
   ``kopf.adopt`` so deleting it deletes them, and delete the router children that a routing
   change left over;
3. read the Deployments' rollouts and each ready pod's /metrics (policy, prefix-cache
   counters), and write the whole status in one patch.

Ready serving pods: an index over the serving pods (``serving_endpoints``, fed by a pod watch
that asks the API server only for the operator's serving pods) holds each ready pod's address.
A kv_aware router lists its workers in its arguments, so a change of the ready set (a scale,
a rolling restart, a pod failing its probe or deleted) re-applies the router Deployment at
once, from the pod event; its rolling update (maxUnavailable 0) keeps a router serving
throughout. Other routing policies discover the pods themselves.

Errors: a child the API server refuses for its content (a 4xx other than 404, 409 and 429)
is permanent: the status says ``Valid=False``/``ApplyRejected`` with the server's message
and a change handler fails for good (the timer tries again each interval, so a fixed
admission policy or quota heals). No response, 5xx, 404 (the namespace is gone), 409 (two
applies racing to create one child) and 429 are transient: kopf retries after
``RETRY_DELAY_S``.

Deleted children: a child deleted behind the operator's back (``kubectl delete deployment``)
is recreated at once, not at the next timer pass: an event handler on the child kinds,
watched with a server-side label selector on the operator's ``managed-by`` label (so kopf
never lists or streams anyone else's objects), looks the owner up in an in-memory index of
ServingPolicies (kopf's ``@kopf.index``, fed by the watch the operator already has, so no
extra ``get`` permission) and re-applies its children under the owner's lock. It skips an
owner that is itself being deleted (the garbage collector is removing the children) and an
invalid spec (the timer reports it). Edited children are put back by the timer's apply, whose
interval bounds every repair that an event missed.

Router children left over (a routing change to none drops them all; between kv_aware and the
discovery policies the Role and RoleBinding come and go) are deleted by name. Which ones exist
comes from indexes over the child watches (``router_<plural>``, the children labelled
``app.kubernetes.io/component: router``), so every pass deletes exactly the router children
that exist and the spec does not want: level-triggered, nothing to remember across restarts,
and a child brought back by a repair that raced the change goes at the next pass.

Convergence: children are written only with server-side apply, as field manager
``arc_operator.FIELD_MANAGER`` with ``force``, so the operator owns every field its manifests
set and takes back any that another manager changed. Every pass applies every child, and the
API server does the comparing: it holds the applied fields in their stored form (quantities
canonical, defaults filled in), so an apply that changes nothing writes nothing (no new
resourceVersion, no rollout), an apply creates a missing child, and a field dropped from a
manifest is removed. Re-running any handler, or restarting the operator, therefore converges
without duplicates, and the timer's pass repairs drift within one interval.

The timer's interval is fixed when the handlers are registered, so ``register`` takes the
validated settings; importing this module registers them on kopf's default registry with
the settings from the environment (an invalid variable stops the import, naming it).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from arc_operator import FINALIZER, GROUP, PLURAL, VERSION
from arc_operator import manifests as mf
from arc_operator.kube import PLURALS, ApiError, KubeApi, login, object_path
from arc_operator.metrics import MetricsError, PodMetrics, hit_rate, parse_metrics, pod_hit_rates
from arc_operator.models import (
    OperatorConfig,
    RoutingPolicy,
    ServingPolicySpec,
    SpecError,
    parse_spec,
)
from arc_operator.status import (
    APPLY_REJECTED,
    INVALID_SPEC,
    Observation,
    Rollout,
    build_status,
    status_patch,
)

# How long kopf waits before retrying after a transient API error.
RETRY_DELAY_S = 10.0
# 4xx statuses that retrying can cure: a namespace not there (yet), two creating applies
# racing, throttling.
TRANSIENT_CLIENT_ERRORS = frozenset({404, 409, 429})
# How long a running status/repair pass may take to finish when the operator stops.
SHUTDOWN_GRACE_S = 10.0


# The child kinds whose deletion triggers a repair: (group, version, plural).
CHILD_KINDS = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
)
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# The server-side selector of every child watch: the API server streams only managed objects.
CHILD_SELECTOR = f"{MANAGED_BY_LABEL}={mf.MANAGED_BY}"
POD_KIND = ("", "v1", "pods")
# The serving pods, and only those (router pods have another app.kubernetes.io/name).
SERVING_POD_LABELS = {MANAGED_BY_LABEL: mf.MANAGED_BY, "app.kubernetes.io/name": mf.ENGINE_NAME}
SERVING_POD_SELECTOR = ",".join(f"{key}={value}" for key, value in SERVING_POD_LABELS.items())
# The ready serving pods of each ServingPolicy: the index kopf hands to handlers by this name.
EndpointIndex = kopf.Index[tuple[str, str], mf.Endpoint]
# The router children that exist, one index per child kind (kind names by owner), handed to
# handlers under ``router_<plural>``.
KINDS = {plural: kind for kind, plural in PLURALS.items()}
ROUTER_INDEXES = tuple(f"router_{plural}" for _, _, plural in CHILD_KINDS)
ROUTER_CHILD_LABELS = {
    MANAGED_BY_LABEL: mf.MANAGED_BY,
    mf.COMPONENT_LABEL: mf.ROUTER_COMPONENT,
    mf.POLICY_LABEL: kopf.PRESENT,
}


def router_children_present(
    indexes: Mapping[str, Any], namespace: str, name: str
) -> frozenset[str]:
    """The kinds of the router children of ``namespace/name`` that exist, from the
    ``router_<plural>`` indexes among a handler's kwargs."""
    return frozenset(
        kind for index in ROUTER_INDEXES for kind in indexes[index].get((namespace, name), [])
    )


@dataclass(frozen=True, slots=True)
class Runtime:
    """Clients and settings shared by every handler; built once in on.startup.

    Invariant: ``locks`` holds one lock per live ServingPolicy (namespace, name), created on
    first use and dropped when the ServingPolicy is deleted; every write to that policy's
    children happens under it, so the change handlers, the timer, the deleted-child repair and
    the pod watch never interleave their reads and writes. ``router_workers`` holds, per
    ServingPolicy with a kv_aware router, the endpoints its Deployment was last applied with
    (written under the lock, dropped with the lock), so a pod event that leaves the ready set
    as it was applies nothing.
    """

    config: OperatorConfig
    api: KubeApi
    http: aiohttp.ClientSession
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    router_workers: dict[tuple[str, str], tuple[mf.Endpoint, ...]] = field(default_factory=dict)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The lock of ServingPolicy ``namespace/name`` (created on first use)."""
        key = (namespace, name)
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = asyncio.Lock()
        return lock

    def forget(self, namespace: str, name: str) -> None:
        """Drop the lock of a deleted ServingPolicy (a holder keeps its reference)."""
        self.locks.pop((namespace, name), None)
        self.router_workers.pop((namespace, name), None)


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf settings: arc-serving names for its finalizer and annotations, standalone.

    Standalone with CRD scanning off means kopf needs no peering objects and no CRD
    access, which keeps the RBAC rules (``arc_operator.rbac``) minimal.
    """
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.peering.standalone = True
    settings.scanning.disabled = True
    settings.posting.level = logging.INFO
    # Watch only the operator's own children: without a server-side selector kopf would list
    # and stream every Deployment, Service, NetworkPolicy and ConfigMap it can see.
    for group, version, plural in CHILD_KINDS:
        settings.watching.label_selectors[group, version, plural] = CHILD_SELECTOR
    settings.watching.label_selectors[POD_KIND] = SERVING_POD_SELECTOR
    # At shutdown, let a timer finish its pass (a few API calls) instead of orphaning it
    # mid-request while on.cleanup closes the sessions it uses.
    settings.background.instant_exit_timeout = SHUTDOWN_GRACE_S


def rejected(error: ApiError) -> bool:
    """Whether the API server refused a request for its content (retrying cannot help)."""
    return 400 <= error.status < 500 and error.status not in TRANSIENT_CLIENT_ERRORS


def ready_endpoints(index: EndpointIndex, namespace: str, name: str) -> tuple[mf.Endpoint, ...]:
    """The ready serving pods of ServingPolicy ``namespace/name``, sorted by pod name."""
    return tuple(sorted(set(index.get((namespace, name), []))))


async def _apply(
    runtime: Runtime, body: Mapping[str, Any], manifest: dict[str, Any], logger: Any
) -> None:
    kopf.adopt(manifest, owner=body)  # type: ignore[arg-type]  # any owner mapping
    await runtime.api.apply(manifest)
    logger.debug(f"applied {manifest['kind']} {manifest['metadata']['name']}")


async def apply_children(
    runtime: Runtime,
    body: Mapping[str, Any],
    spec: ServingPolicySpec,
    endpoints: tuple[mf.Endpoint, ...],
    logger: logging.Logger | Any,
) -> None:
    """Server-side apply every child of ``body`` (a ServingPolicy) in order, owned by it, the
    router's last; stop at the first error. Raises SpecError, before applying anything, when
    routing needs an image and none is set."""
    meta = body["metadata"]
    name, namespace, config = meta["name"], meta["namespace"], runtime.config
    peers, monitoring = config.peers(), config.monitoring()
    router: list[dict[str, Any]] = []
    if spec.routing_policy is not RoutingPolicy.NONE:
        image = config.router_image_for(spec)
        router = mf.router_children(
            name, namespace, spec, endpoints, image=image, peers=peers, monitoring=monitoring
        )
    for manifest in [*mf.children(name, namespace, spec, peers, monitoring), *router]:
        await _apply(runtime, body, manifest, logger)
    key = (namespace, name)
    if spec.routing_policy is RoutingPolicy.KV_AWARE:
        runtime.router_workers[key] = endpoints
    else:
        runtime.router_workers.pop(key, None)


def _router_kinds(spec: ServingPolicySpec) -> frozenset[str]:
    """The kinds of router child that ``spec`` has (with or without its NetworkPolicy, whose
    absence follows the operator's setting, not the spec)."""
    if spec.routing_policy is RoutingPolicy.NONE:
        return frozenset()
    kinds = {kind for _, kind in mf.ROUTER_KINDS}
    if spec.routing_policy is RoutingPolicy.KV_AWARE:
        kinds -= {"Role", "RoleBinding"}
    return frozenset(kinds)


async def delete_stale_router_children(
    runtime: Runtime,
    namespace: str,
    name: str,
    spec: ServingPolicySpec,
    present: frozenset[str],
    logger: logging.Logger | Any,
) -> None:
    """Delete the router children of kinds in ``present`` (the ones that exist) that ``spec``
    does not have."""
    wanted = _router_kinds(spec)
    if runtime.config.peers() is None:
        wanted -= {"NetworkPolicy"}
    stale = [(version, kind) for version, kind in mf.ROUTER_KINDS if kind in present - wanted]
    for api_version, kind in reversed(stale):
        if await runtime.api.delete(api_version, kind, namespace, mf.router_name(name)):
            logger.info(f"deleted {kind} {mf.router_name(name)} (routing changed)")


def ready_endpoint(pod: Mapping[str, Any]) -> mf.Endpoint | None:
    """A ready pod's endpoint (name and IP); None for a pod not ready or going away."""
    if not _pod_ready(pod):
        return None
    return mf.Endpoint(pod=pod["metadata"]["name"], ip=pod["status"]["podIP"])


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


async def _read_pod(runtime: Runtime, pod: Mapping[str, Any]) -> PodMetrics | None:
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    url = f"http://{host}:{runtime.config.metrics_port}/metrics"
    try:
        timeout = aiohttp.ClientTimeout(total=runtime.config.scrape_timeout)
        async with runtime.http.get(url, timeout=timeout) as response:
            response.raise_for_status()
            return parse_metrics(await response.text())
    except (aiohttp.ClientError, TimeoutError, MetricsError):
        return None


async def scrape(
    runtime: Runtime, namespace: str, name: str
) -> tuple[dict[str, PodMetrics], int, set[str]]:
    """Read every ready pod: (readings by pod name, unreachable count, live pod names)."""
    pods = await runtime.api.list("v1", "pods", namespace, mf.selector_labels(name))
    ready = [pod for pod in pods if _pod_ready(pod)]
    readings = await asyncio.gather(*(_read_pod(runtime, pod) for pod in ready))
    scraped = {
        pod["metadata"]["name"]: reading
        for pod, reading in zip(ready, readings, strict=True)
        if reading is not None
    }
    live = {pod["metadata"]["name"] for pod in pods}
    return scraped, len(ready) - len(scraped), live


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def reconcile(
    *,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger | Any,
    endpoints: tuple[mf.Endpoint, ...],
    router_present: frozenset[str],
    strict: bool,
) -> None:
    """Bring the children to the spec and write the status (see the module doc).

    ``strict`` (change handlers): an invalid spec also posts an ``InvalidSpec`` warning
    event and fails the handler permanently; the timer only records it in the status.
    """
    runtime: Runtime = memo["runtime"]
    # One pass at a time per object: two passes never interleave their applies, so the
    # children always come from one spec.
    async with runtime.lock(body.meta.namespace or "", body.meta.name or ""):
        await _reconcile_locked(
            runtime, body, spec, status, patch, memo, logger, endpoints, router_present, strict
        )


async def _reconcile_locked(
    runtime: Runtime,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger | Any,
    endpoints: tuple[mf.Endpoint, ...],
    router_present: frozenset[str],
    strict: bool,
) -> None:
    name, namespace = body.meta.name or "", body.meta.namespace or ""
    reason = INVALID_SPEC
    try:
        parsed: ServingPolicySpec | None = parse_spec(spec)
        error = None
    except SpecError as problem:
        parsed, error = None, str(problem)
    router_deployment = None
    try:
        if parsed is not None:
            try:
                await apply_children(runtime, body, parsed, endpoints, logger)
                await delete_stale_router_children(
                    runtime, namespace, name, parsed, router_present, logger
                )
            except SpecError as problem:
                parsed, error = None, str(problem)
            except ApiError as problem:
                if not rejected(problem):
                    raise
                parsed, error, reason = None, str(problem), APPLY_REJECTED
        deployment = await runtime.api.get(object_path("apps/v1", "deployments", namespace, name))
        if parsed is not None and parsed.routing_policy is not RoutingPolicy.NONE:
            router_deployment = await runtime.api.get(
                object_path("apps/v1", "deployments", namespace, mf.router_name(name))
            )
        scraped, unreachable, live = await scrape(runtime, namespace, name)
    except ApiError as problem:
        raise kopf.TemporaryError(str(problem), delay=RETRY_DELAY_S) from problem

    # Per-object memo: the previous readings of this object's pods, for the rate.
    previous: dict[str, PodMetrics] = memo.get("readings", {})
    memo["readings"] = {
        **{pod: m for pod, m in previous.items() if pod in live},
        **scraped,
    }
    seen = Observation(
        generation=body.meta.get("generation"),
        spec=parsed,
        error=error,
        rollout=Rollout.from_deployment(deployment),
        scraped=scraped,
        unreachable=unreachable,
        hit_rate=hit_rate(previous, scraped),
        error_reason=reason,
        router=Rollout.from_deployment(router_deployment),
        router_desired=0 if parsed is None else mf.router_replicas(parsed, endpoints),
        replica_hit_rates=pod_hit_rates(previous, scraped),
    )
    patch.status.update(status_patch(build_status(seen, status, _now())))
    if error is not None and strict:
        kopf.warn(body, reason=reason, message=error)
        raise kopf.PermanentError(f"spec not applied ({reason}): {error}")


def owner_snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a repair needs of a ServingPolicy: identity, labels, deletion mark and spec."""
    meta = body["metadata"]
    return copy.deepcopy(
        {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {
                key: meta[key]
                for key in ("name", "namespace", "uid", "labels", "deletionTimestamp")
                if key in meta
            },
            "spec": dict(body.get("spec") or {}),
        }
    )


async def repair_deleted_child(
    runtime: Runtime,
    owners: list[dict[str, Any]],
    index: EndpointIndex,
    logger: logging.Logger | Any,
) -> None:
    """Re-apply the children of the live owners of a deleted child (see the module doc)."""
    for owner in owners:
        meta = owner["metadata"]
        if meta.get("deletionTimestamp"):
            continue  # the owner is going away; its children go with it
        try:
            spec = parse_spec(owner["spec"])
        except SpecError:
            continue  # nothing valid to restore; the timer reports the spec
        async with runtime.lock(meta["namespace"], meta["name"]):
            endpoints = ready_endpoints(index, meta["namespace"], meta["name"])
            try:
                await apply_children(runtime, owner, spec, endpoints, logger)
            except (ApiError, SpecError) as problem:
                # Event handlers are not retried; the timer's next pass is.
                logger.warning(f"repair of {meta['name']} failed, the timer retries: {problem}")


async def follow_ready_pods(
    runtime: Runtime,
    owners: list[dict[str, Any]],
    index: EndpointIndex,
    logger: logging.Logger | Any,
) -> None:
    """Re-apply the kv_aware router Deployment of the live owners whose ready serving pods
    are not the ones it was last applied with (see the module doc)."""
    for owner in owners:
        meta = owner["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        try:
            spec = parse_spec(owner["spec"])
            image = runtime.config.router_image_for(spec)
        except SpecError:
            continue  # the timer reports the spec
        if spec.routing_policy is not RoutingPolicy.KV_AWARE:
            continue  # the other policies discover the pods themselves
        key = (meta["namespace"], meta["name"])
        async with runtime.lock(*key):
            endpoints = ready_endpoints(index, *key)
            if runtime.router_workers.get(key) == endpoints:
                continue
            manifest = mf.router_deployment(meta["name"], meta["namespace"], spec, endpoints, image)
            try:
                await _apply(runtime, owner, manifest, logger)
            except ApiError as problem:
                logger.warning(
                    f"router of {meta['name']} not updated, the timer retries: {problem}"
                )
                continue
            runtime.router_workers[key] = endpoints
            logger.info(f"router of {meta['name']} routes to {[e.pod for e in endpoints]}")


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register the ServingPolicy handlers on ``registry`` with ``config``."""

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings)
        memo["runtime"] = Runtime(
            config=config,
            api=KubeApi(lambda: login(settings)),
            http=aiohttp.ClientSession(),
        )

    @kopf.on.login(registry=registry)
    def login_handler(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        # One login for kopf's core and for KubeApi, so both act as the same identity.
        return login(settings)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        runtime: Runtime | None = memo.get("runtime")
        if runtime is not None:
            await runtime.api.close()
            await runtime.http.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    async def reconcile_on_change(
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        patch: kopf.Patch,
        memo: kopf.Memo,
        logger: logging.Logger,
        name: str,
        namespace: str,
        serving_endpoints: EndpointIndex,
        **indexes: Any,
    ) -> None:
        await reconcile(
            body=body,
            spec=spec,
            status=status,
            patch=patch,
            memo=memo,
            logger=logger,
            endpoints=ready_endpoints(serving_endpoints, namespace, name),
            router_present=router_children_present(indexes, namespace, name),
            strict=True,
        )

    # The id is the name of the kwarg that hands the index to handlers.
    @kopf.index(GROUP, VERSION, PLURAL, id="servingpolicy_owners", registry=registry)
    def servingpolicy_owners(
        body: kopf.Body, name: str, namespace: str, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, name): owner_snapshot(body)}

    @kopf.index(*POD_KIND, id="serving_endpoints", labels=SERVING_POD_LABELS, registry=registry)
    def serving_endpoints(
        body: kopf.Body, labels: kopf.Labels, namespace: str, **_: Any
    ) -> dict[tuple[str, str], mf.Endpoint]:
        # A pod no longer ready maps to nothing, which drops what it contributed before.
        owner, endpoint = labels.get(mf.POLICY_LABEL), ready_endpoint(body)
        return {} if owner is None or endpoint is None else {(namespace, owner): endpoint}

    @kopf.on.event(
        *POD_KIND, id="follow_serving_pods", labels=SERVING_POD_LABELS, registry=registry
    )
    async def follow_serving_pods(
        labels: kopf.Labels,
        namespace: str,
        memo: kopf.Memo,
        logger: logging.Logger,
        servingpolicy_owners: kopf.Index[tuple[str, str], dict[str, Any]],
        serving_endpoints: EndpointIndex,
        **_: Any,
    ) -> None:
        owner = labels.get(mf.POLICY_LABEL)
        if owner is not None:
            owners = list(servingpolicy_owners.get((namespace, owner), []))
            await follow_ready_pods(memo["runtime"], owners, serving_endpoints, logger)

    for group, version, plural in CHILD_KINDS:

        @kopf.index(
            group,
            version,
            plural,
            id=f"router_{plural}",
            labels=ROUTER_CHILD_LABELS,
            registry=registry,
        )
        def router_child(
            labels: kopf.Labels, namespace: str, kind: str = KINDS[plural], **_: Any
        ) -> dict[tuple[str, str], str]:
            # Listed objects carry no kind: it comes from the watched resource (bound here).
            return {(namespace, labels[mf.POLICY_LABEL]): kind}

        @kopf.on.event(
            group,
            version,
            plural,
            id=f"recreate_deleted_{plural}",
            labels={MANAGED_BY_LABEL: mf.MANAGED_BY, mf.POLICY_LABEL: kopf.PRESENT},
            registry=registry,
        )
        async def recreate_deleted_child(
            event: kopf.RawEvent,
            labels: kopf.Labels,
            namespace: str,
            memo: kopf.Memo,
            logger: logging.Logger,
            servingpolicy_owners: kopf.Index[tuple[str, str], dict[str, Any]],
            serving_endpoints: EndpointIndex,
            **_: Any,
        ) -> None:
            if event["type"] != "DELETED":
                return
            owners = list(servingpolicy_owners.get((namespace, labels[mf.POLICY_LABEL]), []))
            await repair_deleted_child(memo["runtime"], owners, serving_endpoints, logger)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="forget_deleted_servingpolicy", registry=registry)
    async def forget_deleted_servingpolicy(
        event: kopf.RawEvent, name: str, namespace: str, memo: kopf.Memo, **_: Any
    ) -> None:
        # The policy is gone from the API: its lock would only leak. Async, so that it runs in
        # the loop that uses the locks (kopf runs sync handlers in a thread pool).
        if event["type"] == "DELETED":
            memo["runtime"].forget(namespace, name)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.status_interval, registry=registry)
    async def repair_and_report(
        body: kopf.Body,
        spec: kopf.Spec,
        status: kopf.Status,
        patch: kopf.Patch,
        memo: kopf.Memo,
        logger: logging.Logger,
        name: str,
        namespace: str,
        serving_endpoints: EndpointIndex,
        **indexes: Any,
    ) -> None:
        await reconcile(
            body=body,
            spec=spec,
            status=status,
            patch=patch,
            memo=memo,
            logger=logger,
            endpoints=ready_endpoints(serving_endpoints, namespace, name),
            router_present=router_children_present(indexes, namespace, name),
            strict=False,
        )


register(kopf.get_default_registry(), OperatorConfig.from_env(os.environ))
