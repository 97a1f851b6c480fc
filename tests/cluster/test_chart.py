"""The chart on a real Kubernetes 1.35 API server: installed as the README's quick start does,
every object stored, no deprecation warning; the CRD established and structural; every ci/
variant (hooks and test pods included) accepted by a server-side dry run in namespaces that
enforce the restricted Pod Security Standard, with the real Prometheus Operator and Gateway API
CRDs; the HTTPRoute through the Gateway API CRD's CEL rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.addons import apply_gateway_api_crds
from tests.cluster.helpers import CHART, Kube, Release, api_warnings, wait_for

pytestmark = pytest.mark.slow

CRD_NAME = "servingpolicies.arcserving.io"
RESTRICTED = (
    "pod-security.kubernetes.io/enforce=restricted",
    "pod-security.kubernetes.io/warn=restricted",
)


@pytest.fixture(scope="module")
def gateway_api_crds(kube: Kube) -> list[str]:
    """GatewayClass, Gateway and HTTPRoute, as a cluster with the Gateway API has them (the
    standard CRDs `make cluster-crds` copies), established; their names."""
    return apply_gateway_api_crds(kube.cluster)


def _manifest_objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_quick_start_install_is_accepted_without_warnings(kube: Kube, release: Release) -> None:
    output = release.install.stdout + release.install.stderr
    assert not api_warnings(output), output
    manifest = kube.helm("get", "manifest", release.name, "-n", release.namespace)
    assert manifest.returncode == 0, manifest.stderr
    objects = _manifest_objects(manifest.stdout)
    kinds = sorted({o["kind"] for o in objects})
    assert {
        "Deployment",
        "ServingPolicy",
        "Secret",
        "Ingress",
        "ClusterRole",
        "PodMonitor",
        "PrometheusRule",
    } <= set(kinds)
    # Every object the chart rendered is stored under its kind, name and namespace, and reading
    # them all back raises no deprecation warning either.
    got = kube.run("get", "-n", release.namespace, "-f", "-", "-o", "json", input=manifest.stdout)
    assert not api_warnings(got.stderr), got.stderr
    stored = json.loads(got.stdout)
    stored_items = stored["items"] if stored.get("kind") == "List" else [stored]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in stored_items) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in objects
    )


def test_helm_status_deployed_and_operator_pod_ready(kube: Kube, release: Release) -> None:
    status = kube.helm("status", release.name, "-n", release.namespace, "-o", "json")
    assert json.loads(status.stdout)["info"]["status"] == "deployed"
    pods = kube.get("pods", "-n", release.namespace, "-l", "app.kubernetes.io/component=operator")
    assert pods is not None and len(pods["items"]) == 1
    pod = pods["items"][0]
    assert pod["spec"]["nodeName"].startswith("kwok-node-")
    assert pod["status"]["phase"] == "Running"


def test_crd_is_established_and_structural(kube: Kube, release: Release) -> None:
    crd = wait_for(
        "the CRD to be Established",
        lambda: (
            c
            if (c := kube.get("crd", CRD_NAME))
            and any(
                x["type"] == "Established" and x["status"] == "True"
                for x in c["status"].get("conditions", [])
            )
            else None
        ),
    )
    conditions = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conditions["NamesAccepted"]["status"] == "True"
    # A non-structural schema sets NonStructuralSchema=True (and the API server then refuses
    # defaulting, pruning and CEL rules); it is absent for a structural one.
    assert "NonStructuralSchema" not in conditions, conditions["NonStructuralSchema"]
    assert crd["status"]["acceptedNames"]["shortNames"] == ["sp"]
    # The stored schema is ours, unchanged: the API server kept every CEL rule.
    ours = yaml.safe_load((CHART / "crds" / f"{CRD_NAME}.yaml").read_text(encoding="utf-8"))
    assert crd["spec"]["versions"][0]["schema"] == ours["spec"]["versions"][0]["schema"], (
        "the API server changed the schema (pruned or defaulted a field)"
    )
    # The API server publishes it in discovery and OpenAPI v3.
    openapi = kube.run("get", "--raw", "/openapi/v3/apis/arcserving.io/v1alpha1")
    assert "ServingPolicy" in openapi.stdout


def _dry_run_ci_variant(kube: Kube, values: Path, namespace: str) -> list[str]:
    """Render the variant and apply it with a server-side dry run, one namespace at a time
    (objects without one go to the release's); the stderr of each apply."""
    rendered = kube.helm(
        "template", "dry", str(CHART), "--namespace", namespace, "--values", str(values)
    )
    assert rendered.returncode == 0, rendered.stderr
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for obj in _manifest_objects(rendered.stdout):
        by_namespace.setdefault(obj["metadata"].get("namespace", namespace), []).append(obj)
    errors = []
    for ns, objects in sorted(by_namespace.items()):
        # Namespaces the variant refers to (watched namespaces, Grafana's) must exist; each
        # enforces and warns at the restricted Pod Security Standard, so a workload (Deployment,
        # Job, hook or test pod) whose pods it would refuse draws a warning.
        if kube.get("namespace", ns) is None:
            kube.run("create", "namespace", ns)
        kube.run("label", "--overwrite", "namespace", ns, *RESTRICTED)
        applied = kube.run(
            "apply",
            "--dry-run=server",
            "-n",
            ns,
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
            check=False,
        )
        assert applied.returncode == 0, f"namespace {ns}: {applied.stderr}"
        errors.append(applied.stderr)
    return errors


# The release brings the ServingPolicy CRD, the variants' custom resources need the others.
@pytest.mark.parametrize("values", sorted((CHART / "ci").glob("*.yaml")), ids=lambda p: p.stem)
def test_ci_variant_passes_server_dry_run(
    kube: Kube,
    release: Release,
    monitoring_crds: list[str],
    gateway_api_crds: list[str],
    values: Path,
) -> None:
    namespace = f"dry-{values.stem}"[:63]
    for stderr in _dry_run_ci_variant(kube, values, namespace):
        assert not api_warnings(stderr), stderr


def _rendered_httproute(kube: Kube, namespace: str, *sets: str) -> dict[str, Any]:
    args = ["template", "route", str(CHART), "--namespace", namespace]
    for value in ("httpRoute.enabled=true", "httpRoute.parentRefs[0].name=public", *sets):
        args += ["--set", value]
    rendered = kube.helm(*args, "--show-only", "templates/httproute.yaml")
    assert rendered.returncode == 0, rendered.stderr
    (route,) = _manifest_objects(rendered.stdout)
    return route


def _dry_run(kube: Kube, namespace: str, obj: dict[str, Any]) -> Any:
    return kube.run(
        "apply", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-",
        input=json.dumps(obj), check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "sets",
    [
        pytest.param((), id="defaults"),
        pytest.param(("servingPolicy.replicas=2",), id="to-the-router"),
        pytest.param(
            (
                "httpRoute.paths={/v1/completions,/v1/chat/completions}",
                "httpRoute.pathType=Exact",
                "httpRoute.hostnames={llm.example.com,*.llm.example.com}",
                "httpRoute.parentRefs[0].namespace=gateway-system",
                "httpRoute.parentRefs[0].sectionName=https",
                "httpRoute.parentRefs[1].name=public",
                "httpRoute.parentRefs[1].namespace=gateway-system",
                "httpRoute.parentRefs[1].sectionName=http",
                "httpRoute.timeouts.request=1h",
                "httpRoute.timeouts.backendRequest=30m",
            ),
            id="every-value",
        ),
    ],
)
def test_rendered_httproute_passes_the_gateway_apis_server_side_checks(
    kube: Kube, release: Release, gateway_api_crds: list[str], sets: tuple[str, ...]
) -> None:
    route = _rendered_httproute(kube, release.namespace, *sets)
    applied = _dry_run(kube, release.namespace, route)
    assert applied.returncode == 0, applied.stderr
    assert not api_warnings(applied.stderr), applied.stderr
    stored = json.loads(applied.stdout)
    # Stored as rendered, with the CRD's defaults filled in (group and kind of each parent).
    assert stored["spec"]["rules"][0]["backendRefs"][0]["port"] == 8000
    assert {ref["kind"] for ref in stored["spec"]["parentRefs"]} == {"Gateway"}


def test_the_gateway_apis_cel_rules_run_on_the_route(
    kube: Kube, release: Release, gateway_api_crds: list[str]
) -> None:
    """The CRD's CEL rules are live here: what the values schema cannot see is refused."""
    route = _rendered_httproute(
        kube,
        release.namespace,
        "httpRoute.timeouts.request=1m",
        "httpRoute.timeouts.backendRequest=5m",
    )
    applied = _dry_run(kube, release.namespace, route)
    assert applied.returncode != 0
    assert "backendRequest timeout cannot be longer than request timeout" in applied.stderr


def test_helm_test_pod_starts_but_only_a_kubelet_can_pass_it(kube: Kube, release: Release) -> None:
    """On kwok's nodes `helm test` creates its pod, which the API server admits and the
    scheduler binds, and kwok reports Running and Ready; but no container runs, so the pod
    never succeeds and `helm test` ends at its timeout, naming the pod. The checks themselves
    (curl against the Service) need a real kubelet."""
    result = kube.helm("test", release.name, "-n", release.namespace, "--timeout", "20s")
    test_pod = f"{release.fullname}-test"
    assert result.returncode != 0
    assert f"Pod/{release.namespace}/{test_pod} not ready" in result.stderr, result.stderr
    pod = kube.get("pod", test_pod, "-n", release.namespace)
    assert pod is not None
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["nodeName"].startswith("kwok-")
    assert pod["status"]["phase"] == "Running"
    kube.run("delete", "pod", test_pod, "-n", release.namespace, "--wait=false")
