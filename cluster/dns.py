"""Cluster DNS for the local cluster: CoreDNS as Kubernetes deploys it, built here.

kwokctl runs no DNS, so this module holds what a node with a real kubelet needs to resolve
Service names the way every cluster does (`NAME.NAMESPACE.svc.cluster.local`):

- ``DNS_SERVICE_IP`` and ``CLUSTER_DOMAIN``: the kubelet's ``clusterDNS`` and ``clusterDomain``;
- ``manifests(...)``: ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap (the
  Corefile), Deployment and the ``kube-dns`` Service, pure functions of a few parameters;
- ``IMAGE``: the CoreDNS binary (``.tools/bin/coredns``, built from the Go module proxy) alone in
  an image built with buildah: ``python -m cluster.dns image`` (``make cluster-images``).

Nothing leaves this machine, so the Corefile forwards nowhere: CoreDNS answers the cluster's
zones and NXDOMAIN for every other name, at once.
"""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.images import addon_main, binary_image
from cluster.netns import SERVICE_RANGE

REPO = Path(__file__).resolve().parent.parent
COREDNS_VERSION = "1.15.0"  # cluster/tools/coredns/go.mod pins github.com/coredns/coredns
COREDNS_BINARY = REPO / ".tools" / "bin" / "coredns"
IMAGE = f"localhost/arc-serving/coredns:{COREDNS_VERSION}"
CLUSTER_DOMAIN = "cluster.local"
# The kube-dns Service's fixed address, which every pod's resolv.conf names (the kubelet's
# clusterDNS): the tenth of the Service range, as kubeadm takes the tenth of its own.
DNS_SERVICE_IP = str(ipaddress.ip_network(SERVICE_RANGE)[10])
NAMESPACE = "kube-system"
# CoreDNS listens on an unprivileged port and the Service maps port 53 to it, so the container
# runs as a non-root user with every capability dropped (no NET_BIND_SERVICE, no file
# capability on the binary): the restricted Pod Security Standard as it is.
DNS_PORT = 53
CONTAINER_DNS_PORT = 1053
HEALTH_PORT = 8080
READY_PORT = 8181
METRICS_PORT = 9153
# distroless's "nonroot", the user CoreDNS's own image runs as.
IMAGE_USER = 65532
NAME = "coredns"
LABELS = {"k8s-app": "kube-dns"}


def corefile(
    *,
    port: int = CONTAINER_DNS_PORT,
    host: str = "",
    health_port: int = HEALTH_PORT,
    ready_port: int = READY_PORT,
    metrics_port: int = METRICS_PORT,
    kubeconfig: tuple[Path, str] | None = None,
) -> str:
    """The Corefile: Kubernetes' default one without `forward` (and so without `loop`, which
    only guards forwarding). `host` binds every listener to one address (empty: all of the
    pod's); `kubeconfig` (path, context) replaces the in-cluster service account, for CoreDNS
    run as a process beside the cluster."""
    bind = f"    bind {host}\n" if host else ""
    client = f"        kubeconfig {kubeconfig[0]} {kubeconfig[1]}\n" if kubeconfig else ""
    zones = " ".join(f"{zone}:{port}" for zone in (CLUSTER_DOMAIN, "in-addr.arpa", "ip6.arpa"))
    # Reverse zones have no fallthrough: an address that is no Service's or pod's is NXDOMAIN,
    # as there is nothing to forward the question to.
    return (
        f"{zones} {{\n"
        f"{bind}"
        "    errors\n"
        f"    health {host}:{health_port} {{\n"
        "        lameduck 5s\n"
        "    }\n"
        f"    ready {host}:{ready_port}\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
        f"{client}"
        "        pods insecure\n"
        "        ttl 30\n"
        "    }\n"
        f"    prometheus {host}:{metrics_port}\n"
        "    cache 30\n"
        "    reload\n"
        "    loadbalance\n"
        "}\n"
        # Every other name: no `forward` (nothing leaves this machine), NXDOMAIN at once. An
        # empty chain would answer SERVFAIL, which resolvers (glibc, musl, Go) retry as a
        # temporary failure; NXDOMAIN ends a lookup and its search list quickly.
        f".:{port} {{\n"
        f"{bind}"
        "    errors\n"
        "    template ANY ANY {\n"
        "        rcode NXDOMAIN\n"
        "    }\n"
        "}\n"
    )


def manifests(
    image: str = IMAGE,
    *,
    namespace: str = NAMESPACE,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
    replicas: int = 1,
) -> list[dict[str, Any]]:
    """CoreDNS as Kubernetes' addon deploys it (cluster/addons/dns/coredns), in `namespace`:
    its pods on the nodes `node_selector` picks, tolerating `tolerations` besides
    CriticalAddonsOnly, behind the Service kube-dns at ``DNS_SERVICE_IP``."""
    meta = {"name": NAME, "namespace": namespace}
    # The addon's rules, less Endpoints: CoreDNS reads EndpointSlices only.
    rules = [
        {
            "apiGroups": [""],
            "resources": ["services", "pods", "namespaces"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
    ]
    rbac_labels = {"kubernetes.io/bootstrapping": "rbac-defaults"}
    container_ports = [
        {"name": "dns", "containerPort": CONTAINER_DNS_PORT, "protocol": "UDP"},
        {"name": "dns-tcp", "containerPort": CONTAINER_DNS_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    container = {
        "name": NAME,
        "image": image,
        # An image built on this machine: no registry serves it, so never try to pull it.
        "imagePullPolicy": "Never" if image.startswith("localhost/") else "IfNotPresent",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "resources": {
            "limits": {"memory": "170Mi"},
            "requests": {"cpu": "100m", "memory": "70Mi"},
        },
        "ports": container_ports,
        "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": HEALTH_PORT, "scheme": "HTTP"},
            "initialDelaySeconds": 60,
            "timeoutSeconds": 5,
            "successThreshold": 1,
            "failureThreshold": 5,
        },
        "readinessProbe": {"httpGet": {"path": "/ready", "port": READY_PORT, "scheme": "HTTP"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
    pod_spec = {
        "priorityClassName": "system-cluster-critical",
        "serviceAccountName": NAME,
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}, *tolerations],
        "nodeSelector": {"kubernetes.io/os": "linux", **(node_selector or {})},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_USER,
            "runAsGroup": IMAGE_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        # CoreDNS must not resolve through itself.
        "dnsPolicy": "Default",
        "volumes": [
            {
                "name": "config-volume",
                "configMap": {"name": NAME, "items": [{"key": "Corefile", "path": "Corefile"}]},
            }
        ],
    }
    service_ports = [
        {"name": "dns", "port": DNS_PORT, "targetPort": CONTAINER_DNS_PORT, "protocol": "UDP"},
        {"name": "dns-tcp", "port": DNS_PORT, "targetPort": CONTAINER_DNS_PORT, "protocol": "TCP"},
        {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT, "protocol": "TCP"},
    ]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"system:{NAME}", "labels": rbac_labels},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"system:{NAME}", "labels": rbac_labels},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"system:{NAME}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"Corefile": corefile()},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {**meta, "labels": {**LABELS, "kubernetes.io/name": "CoreDNS"}},
            "spec": {
                "replicas": replicas,
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                "selector": {"matchLabels": LABELS},
                "template": {"metadata": {"labels": LABELS}, "spec": pod_spec},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "kube-dns",
                "namespace": namespace,
                "labels": {
                    **LABELS,
                    "kubernetes.io/cluster-service": "true",
                    "kubernetes.io/name": "CoreDNS",
                },
                "annotations": {
                    "prometheus.io/port": str(METRICS_PORT),
                    "prometheus.io/scrape": "true",
                },
            },
            "spec": {"selector": LABELS, "clusterIP": DNS_SERVICE_IP, "ports": service_ports},
        },
    ]


def build_image(binary: Path = COREDNS_BINARY, reference: str = IMAGE) -> bool:
    """CoreDNS alone in an empty image (cluster/images.py); True when it was built."""
    return binary_image(
        binary,
        reference,
        path="/coredns",
        user=IMAGE_USER,
        ports=[f"{CONTAINER_DNS_PORT}/udp", f"{CONTAINER_DNS_PORT}/tcp"],
        labels={
            "org.opencontainers.image.title": NAME,
            "org.opencontainers.image.version": COREDNS_VERSION,
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    return addon_main(
        argv,
        prog="python -m cluster.dns",
        what="cluster DNS",
        image=IMAGE,
        build_image=lambda reference: build_image(reference=reference),
        manifests=manifests,
    )


if __name__ == "__main__":
    sys.exit(main())
