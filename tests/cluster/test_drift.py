"""Drift repair with the real API server's server-side apply: a field the operator owns is put
back, a field someone else added is left alone, and a deleted child comes back."""

from __future__ import annotations

import pytest

from tests.cluster.helpers import HostOperator, Kube, MakePolicy, Release, ready_pods, wait_for

pytestmark = pytest.mark.slow


def _timer_passes(operator: HostOperator, ns: str, name: str) -> int:
    """The operator's finished status-timer passes over one ServingPolicy, from its log."""
    marker = f"[{ns}/{name}] Timer 'register.<locals>.repair_and_report' succeeded"
    return operator.log_text().count(marker)


def test_owned_field_is_put_back_and_foreign_field_kept(
    kube: Kube, release: Release, host_operator: HostOperator, make_policy: MakePolicy
) -> None:
    ns, name = release.namespace, "drift"
    make_policy(name, replicas=1)
    wait_for("one ready pod", lambda: len(ready_pods(kube, ns, name)) == 1)
    kube.run("annotate", "deployment", name, "-n", ns, "example.com/owner=team-ml")
    kube.run("scale", "deployment", name, "-n", ns, "--replicas=3")

    def repaired() -> bool:
        d = kube.get("deployment", name, "-n", ns) or {}
        return d.get("spec", {}).get("replicas") == 1

    wait_for("the operator to put replicas back to 1", repaired)
    # Two more full timer passes (each applies every child again) keep both as they are.
    after = _timer_passes(host_operator, ns, name)
    wait_for("two more timer passes", lambda: _timer_passes(host_operator, ns, name) >= after + 2)
    deployment = kube.get("deployment", name, "-n", ns, "--show-managed-fields")
    assert deployment is not None
    assert deployment["spec"]["replicas"] == 1
    # Server-side apply leaves a field the operator never set to its manager.
    assert deployment["metadata"]["annotations"]["example.com/owner"] == "team-ml"
    managers = {m["manager"]: m["operation"] for m in deployment["metadata"]["managedFields"]}
    assert managers["arc-serving-operator"] == "Apply", managers


def test_deleted_child_is_recreated(kube: Kube, release: Release, make_policy: MakePolicy) -> None:
    ns, name = release.namespace, "recreate"
    make_policy(name, replicas=1)
    for kind, child in (("service", name), ("configmap", f"{name}-policy")):
        original = wait_for(f"{kind}/{child}", lambda k=kind, c=child: kube.get(k, c, "-n", ns))
        kube.run("delete", kind, child, "-n", ns)

        def recreated(
            k: str = kind, c: str = child, uid: str = original["metadata"]["uid"]
        ) -> bool:
            obj = kube.get(k, c, "-n", ns)
            return obj is not None and obj["metadata"]["uid"] != uid

        wait_for(f"{kind}/{child} to come back", recreated)
