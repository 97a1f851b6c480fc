"""A release's life with the real helm on the real API server: upgrade, rollback (the
ServingPolicy's spec goes back and the operator follows it, through the ConfigMap or the pod
template as the switch mode says) and uninstall (the CRD and the ServingPolicies users created
with kubectl stay; with the operator gone, their finalizer holds their deletion).

A release of its own in a namespace of its own, its operator watching only that namespace and
run on this host (kwok runs no container) while the session's operator is stopped."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from arc_serving_common.names import POLICY_ENV
from tests.cluster.helpers import (
    CHART,
    EXAMPLE,
    FINALIZER,
    OUT,
    REGISTRY,
    HostOperator,
    Kube,
    Release,
    api_warnings,
    configured_policy,
    helm_upgrade,
    launch_operator,
    operator_paused,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow

CRD = "servingpolicies.arcserving.io"
USER_POLICY = "by-hand"


@dataclass(frozen=True)
class Life:
    release: Release
    operator: HostOperator

    @property
    def sp(self) -> str:
        return self.release.fullname


@pytest.fixture(scope="module")
def life(kube: Kube, host_operator: HostOperator) -> Iterator[Life]:
    name = f"life-{secrets.token_hex(3)}"
    sets = [
        f"operator.image.registry={REGISTRY}",
        f"servingPolicy.image.registry={REGISTRY}",
        f"router.image.registry={REGISTRY}",
        "servingPolicy.replicas=1",
        f"operator.watchNamespaces={{{name}}}",
    ]
    with operator_paused(host_operator):
        install = kube.helm(
            "install", name, str(CHART), "-n", name, "--create-namespace",
            *(a for s in sets for a in ("--set", s)), "--wait", "--timeout", "5m",
        )  # fmt: skip
        assert install.returncode == 0, install.stderr
        release = Release(name, name, install)
        operator = launch_operator(
            kube, name, f"{release.fullname}-operator", OUT / f"operator-{name}.log"
        )
        try:
            yield Life(release, operator)
        finally:
            if operator.running():
                kube.run("delete", "servingpolicies", "--all", "-n", name, "--timeout=60s",
                         check=False)  # fmt: skip
                operator.stop()
            kube.helm("uninstall", name, "-n", name, "--timeout", "2m")
            for item in (kube.get("servingpolicies", "-n", name) or {}).get("items", []):
                kube.run("patch", "servingpolicy", item["metadata"]["name"], "-n", name,
                         "--type", "merge", "-p", '{"metadata":{"finalizers":null}}',
                         check=False)  # fmt: skip
            kube.run("delete", "namespace", name, "--wait=false", check=False)


def _env(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["env"])


def _mounts_configmap(deployment: dict[str, Any]) -> bool:
    return any("configMap" in v for v in deployment["spec"]["template"]["spec"]["volumes"])


def _rollback(kube: Kube, release: Release, *revision: str) -> None:
    rolled = kube.helm("rollback", release.name, *revision, "-n", release.namespace)
    assert rolled.returncode == 0, rolled.stderr
    assert not api_warnings(rolled.stdout + rolled.stderr), rolled.stderr


def _revisions(kube: Kube, release: Release) -> list[tuple[int, str, str]]:
    listed = kube.helm("history", release.name, "-n", release.namespace, "-o", "json")
    assert listed.returncode == 0, listed.stderr
    return [(r["revision"], r["status"], r["description"]) for r in json.loads(listed.stdout)]


def _pre_delete_hook_args(kube: Kube, release: Release) -> list[str]:
    """The kubectl arguments of the chart's pre-delete hook Job."""
    hooks = kube.helm("get", "hooks", release.name, "-n", release.namespace)
    assert hooks.returncode == 0, hooks.stderr
    jobs = [
        h
        for h in yaml.safe_load_all(hooks.stdout)
        if h and h["kind"] == "Job" and h["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    ]
    assert len(jobs) == 1, jobs
    return list(jobs[0]["spec"]["template"]["spec"]["containers"][0]["args"])


def test_rollback_puts_the_spec_back_and_a_hot_switch_follows(kube: Kube, life: Life) -> None:
    ns, name = life.release.namespace, life.sp
    wait_for("the first report", lambda: reported(kube, ns, name))
    assert configured_policy(kube, ns, name) == {"policy": "trio"}
    before = kube.get("deployment", name, "-n", ns)
    assert before is not None
    helm_upgrade(kube, life.release, "servingPolicy.policy=LRU")
    wait_for(
        "the ConfigMap to say lru", lambda: configured_policy(kube, ns, name) == {"policy": "lru"}
    )
    _rollback(kube, life.release, "1")
    sp = kube.get("servingpolicy", name, "-n", ns)
    assert sp is not None and sp["spec"]["policy"] == "TRIO"
    wait_for("the ConfigMap to say trio again",
             lambda: configured_policy(kube, ns, name) == {"policy": "trio"})  # fmt: skip
    sp = wait_for("the report on generation 3", lambda: reported(kube, ns, name))
    assert sp["metadata"]["generation"] == 3
    # Helm's apply left the operator's finalizer and status alone.
    assert FINALIZER in sp["metadata"]["finalizers"]
    after = kube.get("deployment", name, "-n", ns)
    assert after is not None
    # Hot: the pods were not rolled, by the upgrade or by the rollback.
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert _revisions(kube, life.release)[-1] == (3, "deployed", "Rollback to 1")


def test_rollback_across_a_switch_mode_change_puts_the_pod_template_back(
    kube: Kube, life: Life
) -> None:
    ns, name = life.release.namespace, life.sp
    helm_upgrade(kube, life.release, "servingPolicy.switchMode=Restart", "servingPolicy.policy=ARC")

    def template_says(policy: str) -> dict[str, Any] | None:
        d = kube.get("deployment", name, "-n", ns)
        ok = d and {"name": POLICY_ENV, "value": policy} in _env(d)
        return d if ok and not _mounts_configmap(d) else None

    restart = wait_for("the pod template to name arc", lambda: template_says("arc"))
    # `helm rollback` without a revision: the one before, Hot and TRIO.
    _rollback(kube, life.release)
    sp = kube.get("servingpolicy", name, "-n", ns)
    assert sp is not None
    assert (sp["spec"]["policy"], sp["spec"]["switchMode"]) == ("TRIO", "Hot")

    def hot_again() -> dict[str, Any] | None:
        d = kube.get("deployment", name, "-n", ns)
        names = {e["name"] for e in _env(d)} if d else set()
        ok = d and _mounts_configmap(d) and POLICY_ENV not in names
        return d if ok and configured_policy(kube, ns, name) == {"policy": "trio"} else None

    hot = wait_for("the pod template to mount the ConfigMap again, which says trio", hot_again)
    assert hot["metadata"]["generation"] > restart["metadata"]["generation"]
    wait_for("the report on the rolled-back generation", lambda: reported(kube, ns, name))
    assert _revisions(kube, life.release)[-1][1:] == ("deployed", "Rollback to 3")


def test_uninstall_keeps_the_crd_and_the_servingpolicies_users_created(
    kube: Kube, life: Life
) -> None:
    ns, name = life.release.namespace, life.sp
    if kube.get("secret", "qwen-arc-api-key", "-n", ns) is None:
        kube.run("create", "secret", "generic", "qwen-arc-api-key", "-n", ns,
                 "--from-literal=api-key=not-a-real-key")  # fmt: skip
    body = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    body["metadata"] = {"name": USER_POLICY, "namespace": ns}
    body["spec"]["replicas"] = 1
    kube.run("create", "-f", "-", input=json.dumps(body))
    user = wait_for("the user's ServingPolicy reported", lambda: reported(kube, ns, USER_POLICY))
    children = [("deployment", USER_POLICY), ("service", USER_POLICY),
                ("configmap", f"{USER_POLICY}-policy"), ("networkpolicy", USER_POLICY)]  # fmt: skip
    for kind, child in children:
        wait_for(f"{kind}/{child}", lambda kind=kind, child=child: kube.get(kind, child, "-n", ns))

    # kwok runs no container: the chart's pre-delete hook Job "succeeds" without deleting the
    # chart's ServingPolicy. Its container's command, run here first, does what it does on a
    # real cluster, while the operator still runs to release the finalizer.
    hook = _pre_delete_hook_args(kube, life.release)
    assert hook[:3] == ["delete", "servingpolicies.arcserving.io", name], hook
    kube.run(*hook, timeout=300)
    uninstalled = kube.helm("uninstall", life.release.name, "-n", ns, "--wait", "--timeout", "2m")
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert not api_warnings(uninstalled.stdout + uninstalled.stderr), uninstalled.stderr
    # The operator's pod goes with the release: so does the host process standing in for it.
    life.operator.stop()
    assert kube.get("servingpolicy", name, "-n", ns) is None
    # The CRD stays: helm installs crds/ but never upgrades or deletes it.
    crd = kube.get("crd", CRD)
    assert crd is not None
    assert {"type": "Established", "status": "True"}.items() <= {
        c["type"]: c for c in crd["status"]["conditions"]
    }["Established"].items()
    # The user's ServingPolicy stays, finalizer and children and all.
    left = kube.get("servingpolicy", USER_POLICY, "-n", ns)
    assert left is not None
    assert left["metadata"]["uid"] == user["metadata"]["uid"]
    assert FINALIZER in left["metadata"]["finalizers"]
    for kind, child in children:
        obj = kube.get(kind, child, "-n", ns)
        assert obj is not None, f"{kind}/{child} went with the release"
        owners = [(o["kind"], o["uid"]) for o in obj["metadata"]["ownerReferences"]]
        assert owners == [("ServingPolicy", user["metadata"]["uid"])]
    # With no operator left, nothing releases the finalizer: the deletion waits.
    deleted = kube.run("delete", "servingpolicy", USER_POLICY, "-n", ns, "--timeout=5s",
                       check=False)  # fmt: skip
    print("kubectl delete:", deleted.returncode, deleted.stdout, deleted.stderr)
    assert deleted.returncode != 0 and "timed out" in deleted.stderr, deleted.stderr
    held = kube.get("servingpolicy", USER_POLICY, "-n", ns)
    assert held is not None and held["metadata"]["deletionTimestamp"]
    assert held["metadata"]["finalizers"] == [FINALIZER]
    for kind, child in children:
        assert kube.get(kind, child, "-n", ns) is not None, f"{kind}/{child} went early"
    # Taking the finalizer away by hand lets it go, and the garbage collector its children.
    kube.run("patch", "servingpolicy", USER_POLICY, "-n", ns, "--type", "merge", "-p",
             '{"metadata":{"finalizers":null}}')  # fmt: skip
    wait_for("the ServingPolicy to go",
             lambda: kube.get("servingpolicy", USER_POLICY, "-n", ns) is None)  # fmt: skip
    for kind, child in children:
        wait_for(
            f"{kind}/{child} to be collected",
            lambda kind=kind, child=child: kube.get(kind, child, "-n", ns) is None,
        )
