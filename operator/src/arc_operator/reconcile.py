"""The reconcile of a ServingPolicy, in three steps, and the two partial passes pod and child
events trigger.

``reconcile`` runs, for create, update (of ``spec``), resume and the status timer:

1. ``apply`` (under the object's lock): validate the spec (``models.parse_spec``; an invalid
   spec touches no child), apply the children (Deployment, Service, NetworkPolicy, ConfigMap
   from ``manifests``; the NetworkPolicy admits the operator's configured peers; with routing,
   the router's children, its Deployment built from the ready serving pods), each owned by
   the ServingPolicy via ``kopf.adopt`` so deleting it deletes them, and delete the router
   children that a routing change left over and the PodDisruptionBudgets the spec no longer
   has (see below). Returns ``Applied``.
2. ``observe`` (in the object's observation turn, not under its lock): read the Deployments'
   rollouts and each ready pod's /metrics (policy, prefix-cache counters). Returns
   ``Observed``.
3. ``report`` (pure): the status patch from what was applied and observed, and the readings
   the next pass compares with for the hit rate. Returns ``Report``; the whole status is
   written in one patch.

Locks: the object's lock (``Runtime.lock``) serialises every write to its children, so the
change handlers, the timer, the deleted-child repair and the pod watch never interleave their
applies and the children always come from one spec. A pass takes its observation turn
(``Runtime.observation``) before it lets go of that lock: passes observe and report in the
order they applied, and their readings are merged one pass at a time, in the order they were
taken, as the hit rate needs; meanwhile the next pass, a repair or a router update may apply.
A scrape (up to ``ARC_OPERATOR_SCRAPE_TIMEOUT`` seconds) never holds up an apply.

Ready serving pods: an index over the serving pods (``serving_endpoints``, fed by a pod watch
that asks the API server only for the operator's serving pods) holds each ready pod's address.
A kv_aware router lists its workers in its arguments, so a change of the ready set (a scale,
a rolling restart, a pod failing its probe or deleted) re-applies the router Deployment at
once, from the pod event (``follow_ready_pods``); its rolling update (maxUnavailable 0) keeps
a router serving throughout. Other routing policies discover the pods themselves.

Errors: a child the API server refuses for its content (a 4xx other than 404, 409 and 429)
is permanent: the status says ``Valid=False``/``ApplyRejected`` with the server's message
and a change handler fails for good (the timer tries again each interval, so a fixed
admission policy or quota heals). No response, 5xx, 404 (the namespace is gone), 409 (two
applies racing to create one child) and 429 are transient: kopf retries after
``RETRY_DELAY_S``.

Deleted children (``repair_deleted_child``): a child deleted behind the operator's back is
re-applied under the owner's lock, unless the owner is itself being deleted (the garbage
collector is removing the children) or its spec is invalid (the timer reports it). Edited
children are put back by the timer's apply, whose interval bounds every repair that an event
missed.

Router children left over (a routing change to none drops them all; between kv_aware and the
discovery policies the Role and RoleBinding come and go) are deleted by name. Which ones exist
comes from indexes over the child watches (``router_<plural>``, the children labelled
``app.kubernetes.io/component: router``), so every pass deletes exactly the router children
that exist and the spec does not want: level-triggered, nothing to remember across restarts,
and a child brought back by a repair that raced the change goes at the next pass.

PodDisruptionBudgets exist only with more than one pod (serving replicas, router replicas):
the ones that exist come from an index over their watch (``budgets``, by name), and every pass
deletes those the spec does not have, by name, as for the router children.

Convergence: children are written only with server-side apply, as field manager
``arc_operator.FIELD_MANAGER`` with ``force``, so the operator owns every field its manifests
set and takes back any that another manager changed. Every pass applies every child, and the
API server does the comparing: it holds the applied fields in their stored form (quantities
canonical, defaults filled in), so an apply that changes nothing writes nothing (no new
resourceVersion, no rollout), an apply creates a missing child, and a field dropped from a
manifest is removed. Re-running any pass, or restarting the operator, therefore converges
without duplicates, and the timer's pass repairs drift within one interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from arc_operator import manifests as mf
from arc_operator.kube import ApiError, KubeApi, object_path
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
# The ready serving pods of each ServingPolicy: the index kopf hands to handlers.
EndpointIndex = kopf.Index[tuple[str, str], mf.Endpoint]


def _lock_in(locks: dict[tuple[str, str], asyncio.Lock], key: tuple[str, str]) -> asyncio.Lock:
    lock = locks.get(key)
    if lock is None:
        lock = locks[key] = asyncio.Lock()
    return lock


class Passes:
    """The handler passes in flight, counted so that the clients close after the last one.

    kopf's shutdown outlives its cleanup: it gives a running timer a grace period and then
    leaves it orphaned, an event still in a worker runs its handlers, and a timer that worker
    spawns after kopf's last sweep of the daemons runs every interval until kopf cancels its
    leftover tasks. Each would otherwise meet closed clients.

    Invariants: ``_idle`` is set exactly when no pass is in flight; once ``closing`` is set,
    no pass is admitted.
    """

    def __init__(self) -> None:
        self.closing = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self) -> Iterator[bool]:
        """Yield whether a pass may run (False once closing), counting it while it does."""
        if self.closing:
            yield False
            return
        self._in_flight += 1
        self._idle.clear()
        try:
            yield True
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def close(self, timeout: float) -> bool:
        """Admit no more passes and wait up to ``timeout`` seconds for the running ones;
        False if some were still running."""
        self.closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


@dataclass(frozen=True, slots=True)
class Runtime:
    """Clients and settings shared by every handler; built once in on.startup.

    Invariants: ``locks`` holds one lock per live ServingPolicy (namespace, name), created on
    first use and dropped when the ServingPolicy is deleted; every write to that policy's
    children happens under it. ``observations`` holds its observation turn, taken under
    ``locks`` and held while a pass observes and reports (see the module doc).
    ``router_workers`` holds, per ServingPolicy with a kv_aware router, the endpoints its
    Deployment was last applied with (written under the lock, dropped with the lock), so a
    pod event that leaves the ready set as it was applies nothing. Every handler that uses
    ``api`` or ``http`` runs as one of ``passes``, so ``close`` closes them after the last.
    """

    config: OperatorConfig
    api: KubeApi
    http: aiohttp.ClientSession
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    observations: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    router_workers: dict[tuple[str, str], tuple[mf.Endpoint, ...]] = field(default_factory=dict)
    passes: Passes = field(default_factory=Passes)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The lock of ServingPolicy ``namespace/name`` (created on first use)."""
        return _lock_in(self.locks, (namespace, name))

    def observation(self, namespace: str, name: str) -> asyncio.Lock:
        """The observation turn of ServingPolicy ``namespace/name`` (created on first use)."""
        return _lock_in(self.observations, (namespace, name))

    async def close(self, grace: float) -> bool:
        """Close the clients once the passes in flight end (at most ``grace`` seconds later);
        False if some pass was still running."""
        drained = await self.passes.close(grace)
        await self.api.close()
        await self.http.close()
        return drained

    def forget(self, namespace: str, name: str) -> None:
        """Drop the locks of a deleted ServingPolicy (a holder keeps its reference)."""
        self.locks.pop((namespace, name), None)
        self.observations.pop((namespace, name), None)
        self.router_workers.pop((namespace, name), None)


@dataclass(frozen=True, slots=True)
class Applied:
    """What the apply step did to the object at ``generation``. ``spec`` is the spec the
    children now follow; it is None exactly when ``error`` says why it was not acted on,
    ``reason`` being ``InvalidSpec`` (nothing applied) or ``ApplyRejected`` (the API server
    refused a child).

    Invariant: ``generation`` is the one the spec was read at. kopf hands a handler the
    object's live body, which a newer event replaces while the pass awaits, so the status
    reports this generation, never the body's at report time.
    """

    generation: int | None
    spec: ServingPolicySpec | None
    error: str | None = None
    reason: str = INVALID_SPEC


@dataclass(frozen=True, slots=True)
class Observed:
    """What the observe step read: the serving and router Deployments' rollouts (the router's
    all zero when no router runs), the readings of the ready pods that answered by pod name,
    how many ready pods did not answer, and the names of every pod that exists."""

    rollout: Rollout
    router: Rollout
    scraped: dict[str, PodMetrics]
    unreachable: int
    live: frozenset[str]


@dataclass(frozen=True, slots=True)
class Report:
    """What the report step decided: the status patch, and the readings to keep for the next
    pass (the previous ones of pods still there, updated with this pass's)."""

    status: dict[str, Any]
    readings: dict[str, PodMetrics]


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


def wanted_budgets(name: str, namespace: str, spec: ServingPolicySpec) -> frozenset[str]:
    """The names of the PodDisruptionBudgets ``spec`` has (the serving pods', the router's)."""
    wanted = mf.budgets(name, namespace, spec)
    if spec.routing_policy is not RoutingPolicy.NONE:
        wanted += mf.router_budgets(name, namespace, spec)
    return frozenset(pdb["metadata"]["name"] for pdb in wanted)


async def delete_stale_children(
    runtime: Runtime,
    namespace: str,
    name: str,
    spec: ServingPolicySpec,
    present: tuple[frozenset[str], frozenset[str]],
    logger: logging.Logger | Any,
) -> None:
    """Delete the children that exist and ``spec`` does not have: of ``present``, the router
    children's kinds and the PodDisruptionBudgets' names (a budget over one pod would block
    every node drain)."""
    router_present, budgets_present = present
    wanted = _router_kinds(spec)
    if runtime.config.peers() is None:
        wanted -= {"NetworkPolicy"}
    stale = router_present - wanted
    for api_version, kind in reversed([kind for kind in mf.ROUTER_KINDS if kind[1] in stale]):
        if await runtime.api.delete(api_version, kind, namespace, mf.router_name(name)):
            logger.info(f"deleted {kind} {mf.router_name(name)} (routing changed)")
    for budget in sorted(budgets_present - wanted_budgets(name, namespace, spec)):
        if await runtime.api.delete(mf.BUDGET_API_VERSION, mf.BUDGET_KIND, namespace, budget):
            logger.info(f"deleted {mf.BUDGET_KIND} {budget} (one pod left, or routing off)")


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
) -> tuple[dict[str, PodMetrics], int, frozenset[str]]:
    """Read every ready pod: (readings by pod name, unreachable count, live pod names)."""
    pods = await runtime.api.list("v1", "pods", namespace, mf.selector_labels(name))
    ready = [pod for pod in pods if _pod_ready(pod)]
    readings = await asyncio.gather(*(_read_pod(runtime, pod) for pod in ready))
    scraped = {
        pod["metadata"]["name"]: reading
        for pod, reading in zip(ready, readings, strict=True)
        if reading is not None
    }
    live = frozenset(pod["metadata"]["name"] for pod in pods)
    return scraped, len(ready) - len(scraped), live


async def apply(
    runtime: Runtime,
    body: kopf.Body,
    spec: Mapping[str, Any],
    endpoints: tuple[mf.Endpoint, ...],
    router_present: frozenset[str],
    budgets_present: frozenset[str],
    logger: logging.Logger | Any,
) -> Applied:
    """Step 1: the children of ``body`` brought to ``spec``. A refused child is an
    ``ApplyRejected`` result; a transient API error propagates (ApiError)."""
    name, namespace = body.meta.name or "", body.meta.namespace or ""
    # Read with the spec, before the first await: the body is live.
    generation = body.meta.get("generation")
    try:
        parsed = parse_spec(spec)
    except SpecError as problem:
        return Applied(generation, None, str(problem))
    try:
        await apply_children(runtime, body, parsed, endpoints, logger)
        present = (router_present, budgets_present)
        await delete_stale_children(runtime, namespace, name, parsed, present, logger)
    except SpecError as problem:
        return Applied(generation, None, str(problem))
    except ApiError as problem:
        if not rejected(problem):
            raise
        return Applied(generation, None, str(problem), APPLY_REJECTED)
    return Applied(generation, parsed)


async def observe(runtime: Runtime, namespace: str, name: str, applied: Applied) -> Observed:
    """Step 2: the rollouts and the ready pods' /metrics; API errors propagate (ApiError)."""
    deployment = await runtime.api.get(object_path("apps/v1", "deployments", namespace, name))
    router_deployment = None
    if applied.spec is not None and applied.spec.routing_policy is not RoutingPolicy.NONE:
        router_deployment = await runtime.api.get(
            object_path("apps/v1", "deployments", namespace, mf.router_name(name))
        )
    scraped, unreachable, live = await scrape(runtime, namespace, name)
    return Observed(
        rollout=Rollout.from_deployment(deployment),
        router=Rollout.from_deployment(router_deployment),
        scraped=scraped,
        unreachable=unreachable,
        live=live,
    )


def report(
    applied: Applied,
    observed: Observed,
    *,
    previous_status: Mapping[str, Any] | None,
    previous_readings: Mapping[str, PodMetrics],
    endpoints: tuple[mf.Endpoint, ...],
    now: str,
) -> Report:
    """Step 3: the status patch, the hit rates taken against ``previous_readings``."""
    scraped = observed.scraped
    seen = Observation(
        generation=applied.generation,
        spec=applied.spec,
        error=applied.error,
        rollout=observed.rollout,
        scraped=scraped,
        unreachable=observed.unreachable,
        hit_rate=hit_rate(previous_readings, scraped),
        error_reason=applied.reason,
        router=observed.router,
        router_desired=0 if applied.spec is None else mf.router_replicas(applied.spec, endpoints),
        replica_hit_rates=pod_hit_rates(previous_readings, scraped),
    )
    readings = {
        **{pod: m for pod, m in previous_readings.items() if pod in observed.live},
        **scraped,
    }
    return Report(status_patch(build_status(seen, previous_status, now)), readings)


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
    budgets_present: frozenset[str],
    strict: bool,
) -> None:
    """Bring the children to the spec and write the status (see the module doc).

    ``strict`` (change handlers): an invalid spec also posts an ``InvalidSpec`` warning
    event and fails the handler permanently; the timer only records it in the status.
    """
    runtime: Runtime = memo["runtime"]
    key = (body.meta.namespace or "", body.meta.name or "")
    try:
        async with contextlib.AsyncExitStack() as turn:
            async with runtime.lock(*key):
                applied = await apply(
                    runtime, body, spec, endpoints, router_present, budgets_present, logger
                )
                await turn.enter_async_context(runtime.observation(*key))
            observed = await observe(runtime, *key, applied)
            # Per-object memo: the previous readings of this object's pods, for the rate.
            result = report(
                applied,
                observed,
                previous_status=status,
                previous_readings=memo.get("readings", {}),
                endpoints=endpoints,
                now=_now(),
            )
            memo["readings"] = result.readings
    except ApiError as problem:
        raise kopf.TemporaryError(str(problem), delay=RETRY_DELAY_S) from problem
    patch.status.update(result.status)
    if applied.error is not None and strict:
        kopf.warn(body, reason=applied.reason, message=applied.error)
        raise kopf.PermanentError(f"spec not applied ({applied.reason}): {applied.error}")


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
