"""The real operator, run on this host with the chart's ServiceAccount token, against the real
API server: the chart's ServingPolicy (two replicas, so a kv_aware router) gets its children,
owned by it; kwok runs the pods; the status and printer columns fill in."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.cluster.helpers import (
    REPO,
    HostOperator,
    Kube,
    Release,
    configured_policy,
    helm_upgrade,
    reported,
    wait_for,
)

pytestmark = pytest.mark.slow


def _condition(sp: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in sp.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c
    return None


def _children(name: str) -> list[tuple[str, str]]:
    return [
        ("deployment", name),
        ("service", name),
        ("networkpolicy", name),
        ("configmap", f"{name}-policy"),
        ("deployment", f"{name}-router"),
        ("service", f"{name}-router"),
        ("serviceaccount", f"{name}-router"),
        ("networkpolicy", f"{name}-router"),
    ]


def test_children_exist_owned_by_the_servingpolicy(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    name = release.fullname
    ns = release.namespace
    sp = kube.get("servingpolicy", name, "-n", ns)
    assert sp is not None
    for kind, child in _children(name):
        obj = wait_for(
            f"{kind}/{child}", lambda kind=kind, child=child: kube.get(kind, child, "-n", ns)
        )
        owners = obj["metadata"].get("ownerReferences", [])
        assert [(o["kind"], o["name"], o["uid"], o.get("controller")) for o in owners] == [
            ("ServingPolicy", name, sp["metadata"]["uid"], True)
        ], f"{kind}/{child}: {owners}"
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "arc-serving-operator"
    # kv_aware discovers no pods through the API: no Role or RoleBinding.
    assert kube.get("role", f"{name}-router", "-n", ns) is None
    assert configured_policy(kube, ns, name) == {"policy": "trio"}


def test_serving_and_router_pods_become_ready(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    name = release.fullname
    ns = release.namespace

    def ready_replicas(deployment: str) -> int:
        d = kube.get("deployment", deployment, "-n", ns)
        return int((d or {}).get("status", {}).get("readyReplicas") or 0)

    wait_for("2 ready serving pods", lambda: ready_replicas(name) == 2)
    # The kv_aware router gets its workers as arguments once the serving pods are ready.
    wait_for("the router ready", lambda: ready_replicas(f"{name}-router") == 1)
    pods = kube.get("pods", "-n", ns, "-l", "app.kubernetes.io/component=serving")
    assert pods is not None
    for pod in pods["items"]:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"].startswith("kwok-node-")
        gpus = pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == "1"


def test_status_conditions_and_printer_columns(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    name = release.fullname
    ns = release.namespace

    def reported_with_router() -> dict[str, Any] | None:
        sp = kube.get("servingpolicy", name, "-n", ns)
        if not sp or sp.get("status", {}).get("observedGeneration") != sp["metadata"]["generation"]:
            return None
        router = _condition(sp, "RouterReady")
        return sp if router and router["status"] == "True" else None

    sp = wait_for("the status with RouterReady=True", reported_with_router)
    status = sp["status"]
    assert _condition(sp, "Valid")["status"] == "True"
    assert status["routingPolicy"] == "kv_aware"
    # No pod IP answers under kwok: the metrics readings are unavailable, and say so.
    applied = _condition(sp, "PolicyApplied")
    assert applied is not None
    print("status:", status)
    table = kube.run("get", "servingpolicy", name, "-n", ns, "-o", "wide").stdout
    print(table)
    header, row = table.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "POLICY", "ROUTING", "READY", "HIT"]
    assert row.split()[:3] == [name, "TRIO", "kv_aware"]


def test_operator_log_has_no_error_or_refusal(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    wait_for(
        "the operator to report a status",
        lambda: (kube.get("servingpolicy", release.fullname, "-n", release.namespace) or {}).get(
            "status"
        ),
    )
    assert host_operator.process.poll() is None, host_operator.log_text()
    # Every request the chart's ServiceAccount made was granted, and no handler failed: no
    # ERROR or WARNING line (kopf logs a refused request, a retry or a crash at those levels).
    # (test_rbac.py, later, takes rules away on purpose.)
    bad = [
        line
        for line in host_operator.log_text().splitlines()
        if "[ERROR" in line or "[WARNING" in line or "Traceback" in line or "API error" in line
    ]
    assert not bad, "\n".join(bad)


def test_every_pod_meets_the_restricted_pod_security_standard(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    """The API server's PodSecurity admission judges the operator's, the serving and the router
    pods: labelling the namespace `enforce=restricted` (a server-side dry run) warns about every
    existing pod that would be refused."""
    ns = release.namespace
    wait_for(
        "the serving and router pods",
        lambda: len((kube.get("pods", "-n", ns) or {}).get("items", [])) >= 4,
    )
    components = {
        p["metadata"]["labels"].get("app.kubernetes.io/component")
        for p in (kube.get("pods", "-n", ns) or {})["items"]
    }
    assert {"operator", "serving", "router"} <= components
    labelled = kube.run(
        "label",
        "--dry-run=server",
        "--overwrite",
        "namespace",
        ns,
        "pod-security.kubernetes.io/enforce=restricted",
    )
    print(labelled.stdout, labelled.stderr)
    assert "violate" not in labelled.stderr, labelled.stderr


def test_helm_upgrade_switches_the_policy_as_the_readme_says(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    """README: `helm upgrade ... --reuse-values --set servingPolicy.policy=LRU` switches the
    chart's ServingPolicy; with switchMode Hot only the ConfigMap changes. (As the README has
    it, without `--wait`: helm 4 waits with kstatus, which holds a custom resource to its
    `Ready` condition, and Ready is not True here, where no pod serves /metrics, nor anywhere
    while idle pods have not yet applied a hot switch.)"""
    name, ns = release.fullname, release.namespace
    # The Deployment as the operator left it after the install, not mid-way through its first
    # reconcile (run alone, this test starts before that reconcile has finished).
    wait_for("the operator's report on the install", lambda: reported(kube, ns, name))
    before = kube.get("deployment", name, "-n", ns)
    assert before is not None
    helm_upgrade(kube, release, "servingPolicy.policy=LRU")
    sp = kube.get("servingpolicy", name, "-n", ns)
    assert sp is not None and sp["spec"]["policy"] == "LRU"
    wait_for(
        "the ConfigMap to say lru",
        lambda: configured_policy(kube, ns, name) == {"policy": "lru"},
    )
    after = kube.get("deployment", name, "-n", ns)
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]


def test_operator_requests_all_granted_none_deprecated(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    """The API server's audit log of the operator's own requests (as its ServiceAccount): every
    one allowed by RBAC, none to a deprecated API. (test_rbac.py, later, takes rules away.)"""
    ns = release.namespace
    wait_for(
        "the operator to report a status",
        lambda: (kube.get("servingpolicy", release.fullname, "-n", ns) or {}).get("status"),
    )
    user = f"system:serviceaccount:{ns}:{release.fullname}-operator"
    events = [
        event
        for line in kube.cluster.audit_log.read_text().splitlines()
        if (event := json.loads(line))["user"]["username"] == user
    ]
    assert events, f"no request of {user} in {kube.cluster.audit_log}"
    denied = [
        (e["verb"], e["requestURI"])
        for e in events
        if e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow"
    ]
    assert not denied, denied
    deprecated = [
        (e["verb"], e["requestURI"])
        for e in events
        if "k8s.io/deprecated" in e.get("annotations", {})
    ]
    assert not deprecated, deprecated
    used = sorted(
        {
            (e["verb"], e["objectRef"].get("apiGroup", ""), e["objectRef"]["resource"])
            + ((e["objectRef"]["subresource"],) if "subresource" in e["objectRef"] else ())
            for e in events
            if "objectRef" in e
        }
    )
    print("the operator's requests:", used)


def test_make_e2e_live_passes_against_the_cluster(
    kube: Kube, release: Release, host_operator: HostOperator
) -> None:
    """`make e2e-live` (operator/e2e.sh), as a user runs it on a cluster the chart installed
    the operator on: the example ServingPolicy in the chart's namespace is reconciled, router
    included."""
    env = {
        **kube.env(),
        "KUBECTL": str(kube.cluster.kubectl_path),
        "E2E_NAMESPACE": release.namespace,
        "E2E_TIMEOUT_S": "120",
    }
    try:
        done = subprocess.run(["make", "--no-print-directory", "e2e-live"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "e2e: ServingPolicy reconciled" in done.stdout
        assert "skipped" not in done.stdout
    finally:
        kube.run("delete", "servingpolicy", "qwen-arc", "-n", release.namespace,
                 "--ignore-not-found", "--wait", "--timeout=120s", check=False)  # fmt: skip
