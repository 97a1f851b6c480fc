"""kopf handlers for the ServingPolicy kind (run: ``kopf run -m arc_operator.handlers``).

Create, update (of ``spec``), resume and the status timer all call one ``reconcile``:

1. validate the spec (``models.parse_spec``); an invalid spec touches no child;
2. apply the children (Deployment, Service, NetworkPolicy, ConfigMap from ``manifests``; the
   NetworkPolicy admits the operator's configured peers), each owned by
   the ServingPolicy via ``kopf.adopt`` so deleting it deletes them;
3. read the Deployment's rollout and each ready pod's /metrics (policy, prefix-cache
   counters), and write the whole status in one patch.

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
from arc_operator.kube import ApiError, KubeApi, login, object_path
from arc_operator.metrics import MetricsError, PodMetrics, hit_rate, parse_metrics
from arc_operator.models import OperatorConfig, ServingPolicySpec, SpecError, parse_spec
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
)
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# The server-side selector of every child watch: the API server streams only managed objects.
CHILD_SELECTOR = f"{MANAGED_BY_LABEL}={mf.MANAGED_BY}"


@dataclass(frozen=True, slots=True)
class Runtime:
    """Clients and settings shared by every handler; built once in on.startup.

    Invariant: ``locks`` holds one lock per live ServingPolicy (namespace, name), created on
    first use and dropped when the ServingPolicy is deleted; every write to that policy's
    children happens under it, so the change handlers, the timer and the deleted-child repair
    never interleave their reads and writes.
    """

    config: OperatorConfig
    api: KubeApi
    http: aiohttp.ClientSession
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

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
    # At shutdown, let a timer finish its pass (a few API calls) instead of orphaning it
    # mid-request while on.cleanup closes the sessions it uses.
    settings.background.instant_exit_timeout = SHUTDOWN_GRACE_S


def rejected(error: ApiError) -> bool:
    """Whether the API server refused a request for its content (retrying cannot help)."""
    return 400 <= error.status < 500 and error.status not in TRANSIENT_CLIENT_ERRORS


async def apply_children(
    runtime: Runtime,
    body: Mapping[str, Any],
    spec: ServingPolicySpec,
    logger: logging.Logger | Any,
) -> None:
    """Server-side apply every child of ``body`` (a ServingPolicy) in order, owned by it;
    stop at the first error."""
    meta = body["metadata"]
    api, peers = runtime.api, runtime.config.peers()
    for manifest in mf.children(meta["name"], meta["namespace"], spec, peers):
        kopf.adopt(manifest, owner=body)  # type: ignore[arg-type]  # any owner mapping
        await api.apply(manifest)
        logger.debug(f"applied {manifest['kind']} {manifest['metadata']['name']}")


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
        await _reconcile_locked(runtime, body, spec, status, patch, memo, logger, strict)


async def _reconcile_locked(
    runtime: Runtime,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    memo: kopf.Memo,
    logger: logging.Logger | Any,
    strict: bool,
) -> None:
    name, namespace = body.meta.name or "", body.meta.namespace or ""
    reason = INVALID_SPEC
    try:
        parsed: ServingPolicySpec | None = parse_spec(spec)
        error = None
    except SpecError as problem:
        parsed, error = None, str(problem)
    try:
        if parsed is not None:
            try:
                await apply_children(runtime, body, parsed, logger)
            except ApiError as problem:
                if not rejected(problem):
                    raise
                parsed, error, reason = None, str(problem), APPLY_REJECTED
        deployment = await runtime.api.get(object_path("apps/v1", "deployments", namespace, name))
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
    runtime: Runtime, owners: list[dict[str, Any]], logger: logging.Logger | Any
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
            try:
                await apply_children(runtime, owner, spec, logger)
            except ApiError as problem:
                # Event handlers are not retried; the timer's next pass is.
                logger.warning(f"repair of {meta['name']} failed, the timer retries: {problem}")


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
        **_: Any,
    ) -> None:
        await reconcile(
            body=body, spec=spec, status=status, patch=patch, memo=memo, logger=logger, strict=True
        )

    # The id is the name of the kwarg that hands the index to handlers.
    @kopf.index(GROUP, VERSION, PLURAL, id="servingpolicy_owners", registry=registry)
    def servingpolicy_owners(
        body: kopf.Body, name: str, namespace: str, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        return {(namespace, name): owner_snapshot(body)}

    for group, version, plural in CHILD_KINDS:

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
            **_: Any,
        ) -> None:
            if event["type"] != "DELETED":
                return
            owners = list(servingpolicy_owners.get((namespace, labels[mf.POLICY_LABEL]), []))
            await repair_deleted_child(memo["runtime"], owners, logger)

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
        **_: Any,
    ) -> None:
        await reconcile(
            body=body, spec=spec, status=status, patch=patch, memo=memo, logger=logger, strict=False
        )


register(kopf.get_default_registry(), OperatorConfig.from_env(os.environ))
