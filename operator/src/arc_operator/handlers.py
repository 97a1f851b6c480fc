"""kopf handlers for the ServingPolicy kind (run: ``arc-operator``, see ``__main__``).

Each handler is a few lines calling ``arc_operator.reconcile``, which states what a pass
does, how passes are ordered and how errors are handled:

- create, update (of ``spec``), resume and the status timer: ``reconcile.reconcile``;
- a serving pod event: ``reconcile.follow_ready_pods`` (a kv_aware router's workers follow
  the ready pods);
- a child deleted behind the operator's back: ``reconcile.repair_deleted_child``, at once,
  not at the next timer pass.

Watches and indexes: the child kinds are watched with a server-side label selector on the
operator's ``managed-by`` label (so kopf never lists or streams anyone else's objects), the
pods with one on the serving pods' labels. Handlers find a child's owner in an in-memory
index of ServingPolicies (``servingpolicy_owners``, fed by the watch the operator already
has, so no extra ``get`` permission), the ready serving pods in ``serving_endpoints``, the
router children that exist in one ``router_<plural>`` index per child kind, and the
PodDisruptionBudgets that exist, by name, in ``budgets``.

The timer's interval is fixed when the handlers are registered, so ``register`` takes the
validated settings; importing this module registers them on kopf's default registry with
the settings from the environment (an invalid variable stops the import, naming it).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import kopf

from arc_operator import FINALIZER, GROUP, PLURAL, VERSION
from arc_operator import manifests as mf
from arc_operator.kube import PLURALS, KubeApi, login
from arc_operator.models import OperatorConfig
from arc_operator.reconcile import (
    EndpointIndex,
    Runtime,
    follow_ready_pods,
    ready_endpoint,
    ready_endpoints,
    reconcile,
    repair_deleted_child,
)

# How long a running status/repair pass may take to finish when the operator stops: kopf's
# wait for a timer, then cleanup's wait for every pass before it closes the clients.
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
    ("policy", "v1", "poddisruptionbudgets"),
)
# The PodDisruptionBudgets (serving and router), indexed by name under ``budgets``: a
# reconcile deletes those its spec no longer has (replicas down to 1, routing off).
BUDGET_PLURAL = "poddisruptionbudgets"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
# The server-side selector of every child watch: the API server streams only managed objects.
CHILD_SELECTOR = f"{MANAGED_BY_LABEL}={mf.MANAGED_BY}"
CHILD_LABELS = {MANAGED_BY_LABEL: mf.MANAGED_BY, mf.POLICY_LABEL: kopf.PRESENT}
POD_KIND = ("", "v1", "pods")
# The serving pods, and only those (router pods have another app.kubernetes.io/name).
SERVING_POD_LABELS = {MANAGED_BY_LABEL: mf.MANAGED_BY, "app.kubernetes.io/name": mf.ENGINE_NAME}
SERVING_POD_SELECTOR = ",".join(f"{key}={value}" for key, value in SERVING_POD_LABELS.items())
# The router children that exist, one index per child kind (kind names by owner), handed to
# handlers under ``router_<plural>``.
KINDS = {plural: kind for kind, plural in PLURALS.items()}
ROUTER_INDEXES = tuple(
    f"router_{plural}" for _, _, plural in CHILD_KINDS if plural != BUDGET_PLURAL
)
ROUTER_CHILD_LABELS = {
    MANAGED_BY_LABEL: mf.MANAGED_BY,
    mf.COMPONENT_LABEL: mf.ROUTER_COMPONENT,
    mf.POLICY_LABEL: kopf.PRESENT,
}
OwnerIndex = kopf.Index[tuple[str, str], dict[str, Any]]
BudgetIndex = kopf.Index[tuple[str, str], str]
# kopf keeps a change handler's progress in annotations named after its id, and names handlers
# in the events it posts: the ids the objects in a cluster already carry.
CHANGE_HANDLER_ID = "register.<locals>.reconcile_on_change"
TIMER_ID = "register.<locals>.repair_and_report"


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


def router_children_present(
    indexes: Mapping[str, Any], namespace: str, name: str
) -> frozenset[str]:
    """The kinds of the router children of ``namespace/name`` that exist, from the
    ``router_<plural>`` indexes among a handler's kwargs."""
    return frozenset(
        kind for index in ROUTER_INDEXES for kind in indexes[index].get((namespace, name), [])
    )


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


# --- the handlers (registered by ``register``) ---------------------------------------------


def login_handler(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    # One login for kopf's core and for KubeApi, so both act as the same identity.
    return login(settings)


async def cleanup(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    runtime: Runtime | None = memo.get("runtime")
    if runtime is not None and not await runtime.close(SHUTDOWN_GRACE_S):
        logger.warning(f"a pass was still running {SHUTDOWN_GRACE_S} s into the shutdown")


def one_pass(handler: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """``handler`` run as one of the runtime's passes: skipped once cleanup has begun, and
    waited for by cleanup before it closes the clients (see ``reconcile.Passes``)."""

    @functools.wraps(handler)
    async def run(*, memo: kopf.Memo, **kwargs: Any) -> None:
        with memo["runtime"].passes.admit() as admitted:
            if admitted:
                await handler(memo=memo, **kwargs)

    return run


@one_pass
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
    budgets: BudgetIndex,
    **indexes: Any,
) -> None:
    await reconcile(
        body=body, spec=spec, status=status, patch=patch, memo=memo, logger=logger,
        endpoints=ready_endpoints(serving_endpoints, namespace, name),
        router_present=router_children_present(indexes, namespace, name),
        budgets_present=frozenset(budgets.get((namespace, name), [])),
        strict=True,
    )  # fmt: skip


@one_pass
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
    budgets: BudgetIndex,
    **indexes: Any,
) -> None:
    await reconcile(
        body=body, spec=spec, status=status, patch=patch, memo=memo, logger=logger,
        endpoints=ready_endpoints(serving_endpoints, namespace, name),
        router_present=router_children_present(indexes, namespace, name),
        budgets_present=frozenset(budgets.get((namespace, name), [])),
        strict=False,
    )  # fmt: skip


def servingpolicy_owners(
    body: kopf.Body, name: str, namespace: str, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    return {(namespace, name): owner_snapshot(body)}


def serving_endpoints(
    body: kopf.Body, labels: kopf.Labels, namespace: str, **_: Any
) -> dict[tuple[str, str], mf.Endpoint]:
    # A pod no longer ready maps to nothing, which drops what it contributed before.
    owner, endpoint = labels.get(mf.POLICY_LABEL), ready_endpoint(body)
    return {} if owner is None or endpoint is None else {(namespace, owner): endpoint}


@one_pass
async def follow_serving_pods(
    labels: kopf.Labels,
    namespace: str,
    memo: kopf.Memo,
    logger: logging.Logger,
    servingpolicy_owners: OwnerIndex,
    serving_endpoints: EndpointIndex,
    **_: Any,
) -> None:
    owner = labels.get(mf.POLICY_LABEL)
    if owner is not None:
        owners = list(servingpolicy_owners.get((namespace, owner), []))
        await follow_ready_pods(memo["runtime"], owners, serving_endpoints, logger)


def router_child_index(kind: str) -> Callable[..., dict[tuple[str, str], str]]:
    """The index handler of the router children of ``kind`` (listed objects carry no kind:
    it comes from the watched resource)."""

    def index(labels: kopf.Labels, namespace: str, **_: Any) -> dict[tuple[str, str], str]:
        return {(namespace, labels[mf.POLICY_LABEL]): kind}

    return index


def budget_index(
    name: str, labels: kopf.Labels, namespace: str, **_: Any
) -> dict[tuple[str, str], str]:
    return {(namespace, labels[mf.POLICY_LABEL]): name}


@one_pass
async def recreate_deleted_child(
    event: kopf.RawEvent,
    labels: kopf.Labels,
    namespace: str,
    memo: kopf.Memo,
    logger: logging.Logger,
    servingpolicy_owners: OwnerIndex,
    serving_endpoints: EndpointIndex,
    **_: Any,
) -> None:
    if event["type"] == "DELETED":
        owners = list(servingpolicy_owners.get((namespace, labels[mf.POLICY_LABEL]), []))
        await repair_deleted_child(memo["runtime"], owners, serving_endpoints, logger)


async def forget_deleted_servingpolicy(
    event: kopf.RawEvent, name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    # The policy is gone from the API: its locks would only leak. Async, so that it runs in
    # the loop that uses the locks (kopf runs sync handlers in a thread pool).
    if event["type"] == "DELETED":
        memo["runtime"].forget(namespace, name)


def spec_changed(diff: kopf.Diff, **_: Any) -> bool:
    """Whether an update touches ``spec``: kopf's ``field="spec"`` filter, which would also
    give the update handler an id of its own."""
    return any(path[:1] == ("spec",) for _, path, _, _ in diff)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register the ServingPolicy handlers on ``registry`` with ``config``."""

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings)
        api = KubeApi(lambda: login(settings))
        memo["runtime"] = Runtime(config=config, api=api, http=aiohttp.ClientSession())

    kopf.on.login(registry=registry)(login_handler)
    kopf.on.cleanup(registry=registry)(cleanup)
    resource = (GROUP, VERSION, PLURAL)
    # One id for all three, so kopf runs one pass when it mixes the resume handler into the
    # first cause of an object it lists at start (a spec changed while no operator ran).
    for on_change in (kopf.on.create, kopf.on.resume):
        on_change(*resource, id=CHANGE_HANDLER_ID, registry=registry)(reconcile_on_change)
    kopf.on.update(*resource, id=CHANGE_HANDLER_ID, when=spec_changed, registry=registry)(
        reconcile_on_change
    )
    # An index's id is the name of the kwarg that hands it to handlers.
    kopf.index(*resource, id="servingpolicy_owners", registry=registry)(servingpolicy_owners)
    kopf.index(*POD_KIND, id="serving_endpoints", labels=SERVING_POD_LABELS, registry=registry)(
        serving_endpoints
    )
    kopf.on.event(
        *POD_KIND, id="follow_serving_pods", labels=SERVING_POD_LABELS, registry=registry
    )(follow_serving_pods)
    for group, version, plural in CHILD_KINDS:
        if plural == BUDGET_PLURAL:
            kopf.index(
                group, version, plural, id="budgets", labels=CHILD_LABELS, registry=registry
            )(budget_index)
        else:
            kopf.index(
                group, version, plural, id=f"router_{plural}", labels=ROUTER_CHILD_LABELS,
                registry=registry,
            )(router_child_index(KINDS[plural]))  # fmt: skip
        kopf.on.event(
            group, version, plural, id=f"recreate_deleted_{plural}", labels=CHILD_LABELS,
            registry=registry,
        )(recreate_deleted_child)  # fmt: skip
    kopf.on.event(*resource, id="forget_deleted_servingpolicy", registry=registry)(
        forget_deleted_servingpolicy
    )
    kopf.timer(*resource, id=TIMER_ID, interval=config.status_interval, registry=registry)(
        repair_and_report
    )


register(kopf.get_default_registry(), OperatorConfig.from_env(os.environ))
