"""Two operators at once, as two replicas of the chart's operator Deployment would run (or two
pods overlapping in a rolling update): the operator runs kopf standalone, without peering, so
nothing elects one. Both act on a new ServingPolicy and on its change; the audit log tells
their requests apart by their tokens. Their applies are server-side applies of the same
manifests by the same field manager, so the outcome is still right: one of each child, owned
once, the status on the current generation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.cluster.helpers import (
    HostOperator,
    Kube,
    MakePolicy,
    Release,
    audit_events,
    audit_offset,
    condition,
    configured_policy,
    credential,
    patch,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow

POLICY_LABEL = "arcserving.io/servingpolicy"


def _patches(
    events: list[dict[str, Any]], ns: str, name: str, resource: str, subresource: str | None = None
) -> Counter[str]:
    """Completed patches of object `name` (a server-side apply is one), per token."""
    return Counter(
        credential(e)
        for e in events
        if e["verb"] == "patch"
        and e["stage"] == "ResponseComplete"
        and e["objectRef"].get("resource") == resource
        and e["objectRef"].get("subresource") == subresource
        and e["objectRef"].get("namespace") == ns
        and e["objectRef"].get("name") == name
    )


def test_two_operators_both_act_and_the_outcome_is_still_right(
    kube: Kube,
    release: Release,
    make_policy: MakePolicy,
    own_operators: Callable[..., HostOperator],
) -> None:
    ns, name = release.namespace, "twice"
    user = f"system:serviceaccount:{ns}:{release.fullname}-operator"
    offset = audit_offset(kube)
    first, second = own_operators(), own_operators()
    make_policy(name, replicas=2)

    def router_ready() -> dict[str, Any] | None:
        sp = reported(kube, ns, name)
        return sp if sp and condition(sp, "RouterReady").get("status") == "True" else None

    sp = wait_for("the report with RouterReady", router_ready)
    tokens = {credential(e) for e in audit_events(kube, offset, user)}
    assert len(tokens) == 2, tokens
    both = wait_for(
        "an apply of the Deployment from each operator",
        lambda: (
            (a := _patches(audit_events(kube, offset, user), ns, name, "deployments"))
            and len(a) == 2
            and a
        ),
    )
    print("applies of the Deployment per operator:", dict(both))
    patch(kube, ns, name, {"policy": "LRU"})
    wait_for(
        "the ConfigMap to say lru", lambda: configured_policy(kube, ns, name) == {"policy": "lru"}
    )
    sp = wait_for("the report on generation 2", lambda: reported(kube, ns, name))
    # Both handle the change (kopf logs each change it processed), each in its own time: the
    # report on generation 2 may come from either.
    processed = f"[{ns}/{name}] Updating is processed: 1 succeeded; 0 failed."
    for operator in (first, second):
        wait_for(
            "the change processed by each operator",
            lambda operator=operator: processed in operator.log_text(),
        )
        assert operator.running(), operator.log_text()
    # One of each child, each owned once by the ServingPolicy.
    uid = sp["metadata"]["uid"]
    listed = kube.get(
        "deployments,services,networkpolicies,configmaps,serviceaccounts,roles,rolebindings",
        "-n", ns, "-l", f"{POLICY_LABEL}={name}",
    )  # fmt: skip
    assert listed is not None
    names = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in listed["items"])
    assert names == sorted(
        [f"Deployment/{name}", f"Deployment/{name}-router", f"Service/{name}",
         f"Service/{name}-router", f"NetworkPolicy/{name}", f"NetworkPolicy/{name}-router",
         f"ConfigMap/{name}-policy", f"ServiceAccount/{name}-router"]
    )  # fmt: skip
    for obj in listed["items"]:
        owners = [(o["uid"], o.get("controller")) for o in obj["metadata"]["ownerReferences"]]
        assert owners == [(uid, True)], obj["metadata"]["name"]
    serving = kube.get("deployment", name, "-n", ns)
    assert serving is not None and serving["metadata"]["generation"] == 1
    # Both keep reporting (a status patch from each after the change), on the current
    # generation, and agree.
    changed = audit_offset(kube)
    wait_for(
        "a status report from each operator",
        lambda: (
            len(_patches(audit_events(kube, changed, user), ns, name, "servingpolicies", "status"))
            == 2
        ),
    )
    sp = wait_for("the report on generation 2", lambda: reported(kube, ns, name))
    print("status:", sp["status"])
    assert sp["spec"]["policy"] == "LRU" and condition(sp, "Valid")["status"] == "True"
    assert condition(sp, "RouterReady")["status"] == "True"
    # Both release the finalizer: the deletion completes, and neither logs an error.
    kube.run("delete", "servingpolicy", name, "-n", ns, "--timeout=60s")
    for operator in (first, second):
        bad = [
            line
            for line in operator.log_text().splitlines()
            if "[ERROR" in line or "Traceback" in line
        ]
        assert not bad, "\n".join(bad)
