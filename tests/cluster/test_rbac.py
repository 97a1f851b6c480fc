"""The chart's RBAC on the real authorizer: the operator runs as the chart's ServiceAccount, so
a rule taken out of its ClusterRole is refused by the API server; the operator reports it as
ApplyRejected with the server's message and heals at its next pass once the rule is back. The
ServiceAccount holds the chart's rules and no more, its Lease's among them."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.cluster.helpers import (
    HostOperator,
    Kube,
    MakePolicy,
    Release,
    condition,
    ready_pods,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_service_account_has_exactly_the_chart_rules(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    sa = f"system:serviceaccount:{release.namespace}:{release.fullname}-operator"
    ns = release.namespace

    def can(verb: str, resource: str, subresource: str = "", namespace: str = ns) -> bool:
        extra = [f"--subresource={subresource}"] if subresource else []
        result = kube.run(
            "auth", "can-i", verb, resource, *extra, "-n", namespace, "--as", sa, check=False
        )
        return result.stdout.strip() == "yes"

    assert can("patch", "servingpolicies.arcserving.io")
    assert can("patch", "servingpolicies.arcserving.io", "status")
    assert not can("update", "servingpolicies.arcserving.io", "status")
    assert can("update", "servingpolicies.arcserving.io", "finalizers")
    assert not can("update", "servingpolicies.arcserving.io")
    assert can("create", "deployments.apps")
    assert can("get", "pods")
    assert not can("get", "secrets")
    assert not can("list", "secrets")
    assert not can("delete", "configmaps")
    assert not can("update", "deployments.apps")
    # The leader election: its own Lease by name, in the release namespace only; create, which
    # RBAC cannot restrict by name, there too.
    leases, lease = "leases.coordination.k8s.io", f"{release.fullname}-operator"
    assert can("create", leases)
    assert can("get", f"{leases}/{lease}") and can("update", f"{leases}/{lease}")
    assert not can("get", f"{leases}/another") and not can("update", f"{leases}/another")
    assert not can("delete", f"{leases}/{lease}") and not can("patch", f"{leases}/{lease}")
    assert not can("list", leases) and not can("watch", leases)
    for verb in ("create", "get", "update"):
        assert not can(verb, f"{leases}/{lease}", namespace="default"), verb


# (id, rule taken out: resource and verb, the ServingPolicy's spec, the child that cannot be
# written, fragments of the API server's refusal)
REMOVED = [
    # The owner references' blockOwnerDeletion needs update on servingpolicies/finalizers under
    # OwnerReferencesPermissionEnforcement (cluster/local.py turns it on): the very first child,
    # the serving Deployment, is refused.
    (
        "finalizers-update",
        ("servingpolicies/finalizers", "update"),
        {"replicas": 1},
        ("deployment", "{name}"),
        ["forbidden", "cannot set blockOwnerDeletion"],
    ),
    (
        "configmaps-patch",
        ("configmaps", "patch"),
        {"replicas": 1},
        ("configmap", "{name}-policy"),
        ["forbidden", "configmaps"],
    ),
    # A server-side apply that creates the object is authorized as create too.
    (
        "configmaps-create",
        ("configmaps", "create"),
        {"replicas": 1},
        ("configmap", "{name}-policy"),
        ["forbidden", "configmaps"],
    ),
    # `get` on pods is held only to be granted: without it RBAC's escalation check refuses the
    # discovery router's Role (pods get, list, watch).
    (
        "pods-get-delegation",
        ("pods", "get"),
        {"replicas": 2, "routing": {"policy": "round_robin"}},
        ("role", "{name}-router"),
        ["forbidden", "attempting to grant RBAC permissions not currently held"],
    ),
]


@pytest.mark.parametrize(
    ("removed", "spec", "child", "fragments"), [r[1:] for r in REMOVED], ids=[r[0] for r in REMOVED]
)
def test_removed_rule_is_reported_as_apply_rejected_and_heals(
    kube: Kube,
    release: Release,
    make_policy: MakePolicy,
    removed: tuple[str, str],
    spec: dict[str, Any],
    child: tuple[str, str],
    fragments: list[str],
) -> None:
    ns, name = release.namespace, f"rbac-{removed[0].split('/')[-1]}-{removed[1]}"
    child_kind, child_name = child[0], child[1].format(name=name)
    role_name = f"{release.fullname}-operator"
    role = kube.get("clusterrole", role_name)
    assert role is not None
    original = copy.deepcopy(role)
    for rule in role["rules"]:
        if rule.get("resources") == [removed[0]]:
            rule["verbs"] = [v for v in rule["verbs"] if v != removed[1]]
    role["rules"] = [rule for rule in role["rules"] if rule["verbs"]]
    role["metadata"].pop("resourceVersion", None)
    kube.run("replace", "-f", "-", input=json.dumps(role))
    try:
        make_policy(name, **spec)

        def rejected() -> dict[str, Any] | None:
            sp = kube.get("servingpolicy", name, "-n", ns) or {}
            valid = condition(sp, "Valid")
            return valid if valid.get("reason") == "ApplyRejected" else None

        valid = wait_for("Valid=False ApplyRejected", rejected)
        assert valid["status"] == "False"
        for fragment in fragments:
            assert fragment in valid["message"], valid
        # The serving Deployment goes first; the refused child is not there.
        assert kube.get(child_kind, child_name, "-n", ns) is None
        if (child_kind, child_name) != ("deployment", name):
            assert kube.get("deployment", name, "-n", ns) is not None

        def rejection_events() -> list[dict[str, Any]] | None:
            events = kube.get(
                "events",
                "-n",
                ns,
                "--field-selector",
                f"involvedObject.name={name},reason=ApplyRejected",
            )
            return (events or {}).get("items") or None

        # kopf posts events from a queue of its own, after the status patch.
        events = wait_for("an ApplyRejected event", rejection_events)
        assert events[0]["type"] == "Warning"
    finally:
        original["metadata"].pop("resourceVersion", None)
        kube.run("replace", "-f", "-", input=json.dumps(original))
    # The status timer applies again: the child appears and Valid turns True.
    wait_for(
        f"{child_kind}/{child_name} after the rule is back",
        lambda: kube.get(child_kind, child_name, "-n", ns),
    )

    def healed() -> dict[str, Any] | None:
        sp = reported(kube, ns, name)
        return sp if sp and condition(sp, "Valid").get("status") == "True" else None

    wait_for("Valid=True after the rule is back", healed)
    wait_for("ready pods", lambda: len(ready_pods(kube, ns, name)) == spec["replicas"])
