"""The local cluster's add-ons on its real node, what every cluster a user installs the chart on
has: cluster DNS (CoreDNS, cluster/dns.py) and an ingress controller (Traefik, cluster/ingress.py)
with the Gateway API's standard CRDs; and a kubectl image for the chart's pre-delete hook.

``install(cluster)`` imports the images into the real node (`make cluster-images` builds them),
applies the CRDs (`make cluster-crds` copies them) and the manifests, and waits until both
Deployments are available; it returns where the ingress answers. Applying is idempotent: a second
call changes nothing.

``KUBECTL_IMAGE``: the kubectl the Makefile installs (`.tools/bin/kubectl`) alone in an image,
as registry.k8s.io/kubectl is (distroless, user 65532, kubectl its entrypoint), which nothing
may download here: `python -m cluster.addons kubectl-image`; the chart's `cleanup.image` names
it on this cluster.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster import dns, ingress
from cluster.images import binary_image, build_and_report
from cluster.local import REPO, ClusterError, LocalCluster

GATEWAY_API_CRDS = REPO / "out" / "cluster" / "crds" / "gateway-api"
REAL_NODE_SELECTOR = {"type": "real"}
READY_TIMEOUT_S = 180.0
KUBECTL_BINARY = REPO / ".tools" / "bin" / "kubectl"
KUBECTL_VERSION = "v1.35.2"  # the Makefile's kubectl, and the chart's cleanup.image.tag
KUBECTL_IMAGE = f"localhost/arc-serving/kubectl:{KUBECTL_VERSION}"
# registry.k8s.io/kubectl's user ("nonroot"), which the chart's hook runs as.
KUBECTL_USER = 65532


@dataclass(frozen=True)
class Addons:
    """Where the add-ons answer, from inside the cluster's network namespace."""

    ingress_url: str
    dns_address: str
    imported_s: dict[str, float | None]


def _apply(cluster: LocalCluster, objects: list[dict[str, Any]]) -> None:
    listed = {"apiVersion": "v1", "kind": "List", "items": objects}
    applied = cluster.kubectl("apply", "-f", "-", input=json.dumps(listed), timeout=120)
    if applied.returncode != 0:
        raise ClusterError(f"kubectl apply of the add-ons failed: {applied.stderr.strip()}")


def apply_gateway_api_crds(cluster: LocalCluster, crds: Path = GATEWAY_API_CRDS) -> list[str]:
    """Apply the Gateway API's standard CRDs and wait until each is established; their names
    as kubectl prints them (customresourcedefinition.apiextensions.k8s.io/NAME)."""
    files = sorted(crds.glob("*.yaml"))
    if not files:
        raise ClusterError(f"no Gateway API CRDs in {crds}: run `make cluster-crds`")
    names = []
    for path in files:
        applied = cluster.kubectl("apply", "--server-side", "-f", str(path), "-o", "name")
        if applied.returncode != 0:
            raise ClusterError(f"kubectl apply {path.name} failed: {applied.stderr.strip()}")
        names.append(applied.stdout.strip())
    for name in names:
        waited = cluster.kubectl(
            "wait", "--for=condition=Established", name, "--timeout=60s", timeout=90
        )
        if waited.returncode != 0:
            raise ClusterError(f"{name} not established: {waited.stderr.strip()}")
    return names


def _wait_available(cluster: LocalCluster, namespace: str, name: str, deadline: float) -> None:
    left = max(1, int(deadline - time.monotonic()))
    waited = cluster.kubectl(
        "rollout", "status", f"deployment/{name}", "-n", namespace, f"--timeout={left}s",
        timeout=left + 30,
    )  # fmt: skip
    if waited.returncode != 0:
        pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
        events = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp")
        stopped = cluster.stopped_components()
        raise ClusterError(
            f"deployment {namespace}/{name} not available after {READY_TIMEOUT_S:.0f} s: "
            f"{waited.stderr.strip()}\n{pods}\n{events.stdout[-4000:]}"
            f"\ncontrol plane components not running: {', '.join(stopped) or 'none'}"
            f" (logs in {cluster.cluster_dir}/logs)"
        )


def install(cluster: LocalCluster, timeout: float = READY_TIMEOUT_S) -> Addons:
    """DNS and the ingress controller on the cluster's real node, both Deployments available."""
    if not cluster.real_node.ready():
        raise ClusterError("the add-ons run on the real node, which is not Ready (make cluster)")
    imported = cluster.real_node.import_images([dns.IMAGE, ingress.IMAGE, KUBECTL_IMAGE])
    apply_gateway_api_crds(cluster)
    _apply(cluster, dns.manifests(node_selector=REAL_NODE_SELECTOR))
    _apply(cluster, ingress.manifests(ingress.IMAGE, node_selector=REAL_NODE_SELECTOR))
    deadline = time.monotonic() + timeout
    _wait_available(cluster, dns.NAMESPACE, dns.NAME, deadline)
    _wait_available(cluster, ingress.NAMESPACE, ingress.NAME, deadline)
    service = cluster.kubectl("get", "service", ingress.NAME, "-n", ingress.NAMESPACE, "-o", "json")
    if service.returncode != 0:
        raise ClusterError(f"no Service {ingress.NAMESPACE}/{ingress.NAME}: {service.stderr}")
    address = json.loads(service.stdout)["spec"]["clusterIP"]
    return Addons(
        ingress_url=f"http://{address}:{ingress.SERVICE_PORT}",
        dns_address=dns.DNS_SERVICE_IP,
        imported_s=imported,
    )


def build_kubectl_image(binary: Path = KUBECTL_BINARY, reference: str = KUBECTL_IMAGE) -> bool:
    """kubectl alone in an empty image; True when it was built, False when current."""
    reported = subprocess.run(
        [str(binary), "version", "--client", "-o", "json"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if reported.returncode != 0:
        raise SystemExit(f"{binary} does not run: {reported.stderr.strip()} (make tools)")
    version = json.loads(reported.stdout)["clientVersion"]["gitVersion"]
    if version != KUBECTL_VERSION:
        raise SystemExit(f"{binary} is kubectl {version}, not {KUBECTL_VERSION} (make tools)")
    return binary_image(
        binary,
        reference,
        path="/bin/kubectl",
        user=KUBECTL_USER,
        labels={
            "org.opencontainers.image.title": "kubectl",
            "org.opencontainers.image.version": version,
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.addons", description="The add-ons' kubectl image."
    )
    parser.add_argument("command", choices=["kubectl-image"])
    parser.parse_args(argv)
    build_and_report(KUBECTL_IMAGE, build_kubectl_image)
    return 0


if __name__ == "__main__":
    sys.exit(main())
