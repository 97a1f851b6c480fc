"""The local cluster's ingress controller: Traefik, which implements both Ingress and the Gateway
API (HTTPRoute) in one Go binary, built here (cluster/tools/traefik/go.mod, `make
cluster-binaries`).

- ``manifests(...)``: Namespace, ServiceAccount, ClusterRole, ClusterRoleBinding, IngressClass
  and GatewayClass ``traefik``, a Gateway listening for HTTP on ``WEB_PORT``, the Deployment and
  its Service, as Traefik's Helm chart deploys them for its kubernetesIngress and
  kubernetesGateway providers; pure functions of a few parameters;
- ``traefik_args(...)``: Traefik's static configuration as command-line flags, shared by the
  Deployment and by tests that run the binary as a process;
- ``IMAGE``: the binary alone in an image built with buildah: ``python -m cluster.ingress
  image`` (``make cluster-images``).

Traefik needs the Gateway API's standard CRDs (`make cluster-crds`) before it starts: its
Gateway provider waits until it can list GRPCRoutes, ReferenceGrants and BackendTLSPolicies too.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.images import addon_main, binary_image

REPO = Path(__file__).resolve().parent.parent
GO_MOD = REPO / "cluster" / "tools" / "traefik" / "go.mod"
TRAEFIK_MODULE = "github.com/traefik/traefik/v3"
TRAEFIK_BINARY = REPO / ".tools" / "bin" / "traefik"


def pinned_version(go_mod: Path = GO_MOD, module: str = TRAEFIK_MODULE) -> str:
    """The version of ``module`` that ``go_mod`` requires: the one the Makefile builds."""
    for line in go_mod.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == module:
            return words[1]
    raise ValueError(f"{go_mod} requires no {module}")


TRAEFIK_VERSION = pinned_version()
IMAGE = f"localhost/arc-serving/traefik:{TRAEFIK_VERSION}"
NAME = "traefik"
NAMESPACE = "traefik"
CLASS_NAME = "traefik"
GATEWAY_CONTROLLER = "traefik.io/gateway-controller"
INGRESS_CONTROLLER = "traefik.io/ingress-controller"
# The Helm chart's ports: the entry point `web` (Ingresses, and the Gateway's listener, which
# Traefik binds to the entry point of the same port), and `traefik` (/ping for the probes).
# Both unprivileged, so the container needs no capability.
WEB_PORT = 8000
PING_PORT = 8080
SERVICE_PORT = 80
# distroless's "nonroot", the user the Helm chart runs Traefik as.
IMAGE_USER = 65532
# The pod's own emptyDir, mounted there: nothing else shares it (bandit's B108 is about a
# shared /tmp on a host).
TMP_DIR = "/tmp"  # nosec B108
LABELS = {"app.kubernetes.io/name": "traefik", "app.kubernetes.io/instance": NAME}


def traefik_args(
    *, bind: str = "", web_port: int = WEB_PORT, ping_port: int = PING_PORT
) -> list[str]:
    """Traefik's static configuration: the two entry points on ``bind`` (every address when
    empty), both Kubernetes providers over every namespace, and nothing that calls out. No
    Gateway status address: Traefik takes it only from a LoadBalancer Service's status, which
    no controller fills here."""
    return [
        f"--entryPoints.web.address={bind}:{web_port}/tcp",
        f"--entryPoints.traefik.address={bind}:{ping_port}/tcp",
        "--ping=true",
        "--providers.kubernetesIngress=true",
        "--providers.kubernetesGateway=true",
        # Traefik would otherwise ask GitHub for newer releases and send usage statistics.
        "--global.checkNewVersion=false",
        "--global.sendAnonymousUsage=false",
        "--log.level=INFO",
        "--log.noColor=true",
        # A line per request, with its status, duration and backend: what a failed replay
        # request met at the ingress.
        "--accesslog=true",
    ]


def cluster_role_rules() -> list[dict[str, Any]]:
    """The rules Traefik's docs give its kubernetesIngress and kubernetesGateway providers,
    together, less `pods get` (only for OpenTelemetry's pod attributes, which are off), plus
    `nodes list watch`: the Ingress provider of v3.6 waits for a node informer too (for
    NodePortLB Services) unless cluster-scope lookups are disabled, which would also drop
    IngressClasses."""
    read = ["get", "list", "watch"]
    gateway_kinds = [
        "gatewayclasses",
        "gateways",
        "httproutes",
        "grpcroutes",
        "tcproutes",
        "tlsroutes",
        "referencegrants",
        "backendtlspolicies",
    ]
    return [
        {"apiGroups": [""], "resources": ["namespaces", "nodes"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["services", "secrets", "configmaps"], "verbs": read},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
        {
            "apiGroups": ["extensions", "networking.k8s.io"],
            "resources": ["ingresses", "ingressclasses"],
            "verbs": read,
        },
        {
            "apiGroups": ["extensions", "networking.k8s.io"],
            "resources": ["ingresses/status"],
            "verbs": ["update"],
        },
        {"apiGroups": ["gateway.networking.k8s.io"], "resources": gateway_kinds, "verbs": read},
        {
            "apiGroups": ["gateway.networking.k8s.io"],
            "resources": [f"{kind}/status" for kind in gateway_kinds],
            "verbs": ["update"],
        },
    ]


def manifests(
    image: str = IMAGE,
    *,
    namespace: str = NAMESPACE,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
    web_port: int = WEB_PORT,
) -> list[dict[str, Any]]:
    """Traefik in ``namespace`` (created, enforcing the restricted Pod Security Standard) on the
    nodes ``node_selector`` picks (the real node, ``{"type": "real"}``, by default), with the
    IngressClass and GatewayClass ``traefik`` and the Gateway ``traefik`` in ``namespace``,
    whose HTTP listener on ``web_port`` takes routes from every namespace. The Service
    ``traefik`` maps port 80 to the entry point, as the Helm chart's does."""
    meta = {"name": NAME, "namespace": namespace, "labels": LABELS}
    cluster_name = f"{NAME}-{namespace}"  # one per installation, as the Helm chart names it
    container = {
        "name": NAME,
        "image": image,
        # An image built on this machine: no registry serves it, so never try to pull it.
        "imagePullPolicy": "Never" if image.startswith("localhost/") else "IfNotPresent",
        "args": traefik_args(web_port=web_port),
        "ports": [
            {"name": "web", "containerPort": web_port, "protocol": "TCP"},
            {"name": "traefik", "containerPort": PING_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/ping", "port": PING_PORT, "scheme": "HTTP"},
            "periodSeconds": 10,
            "failureThreshold": 1,
        },
        "livenessProbe": {
            "httpGet": {"path": "/ping", "port": PING_PORT, "scheme": "HTTP"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        # Measured with two routes: 125 MiB resident, of which 17 MiB its own memory and the
        # rest pages of its 178 MB binary (cluster/README.md); the limit leaves it room to grow.
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "256Mi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_DIR}],
    }
    pod_spec = {
        "serviceAccountName": NAME,
        "nodeSelector": dict(node_selector if node_selector is not None else {"type": "real"}),
        "tolerations": [dict(t) for t in tolerations],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_USER,
            "runAsGroup": IMAGE_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    listener = {
        "name": "web",
        "port": web_port,
        "protocol": "HTTP",
        "allowedRoutes": {"namespaces": {"from": "All"}},
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": namespace,
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/warn": "restricted",
                },
            },
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": cluster_name, "labels": LABELS},
            "rules": cluster_role_rules(),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": cluster_name, "labels": LABELS},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_name,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "IngressClass",
            "metadata": {"name": CLASS_NAME, "labels": LABELS},
            "spec": {"controller": INGRESS_CONTROLLER},
        },
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "GatewayClass",
            "metadata": {"name": CLASS_NAME, "labels": LABELS},
            "spec": {"controllerName": GATEWAY_CONTROLLER},
        },
        {
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": meta,
            "spec": {"gatewayClassName": CLASS_NAME, "listeners": [listener]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": LABELS},
                "template": {"metadata": {"labels": LABELS}, "spec": pod_spec},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": LABELS,
                "ports": [
                    {"name": "web", "port": SERVICE_PORT, "targetPort": "web", "protocol": "TCP"}
                ],
            },
        },
    ]


def build_image(binary: Path = TRAEFIK_BINARY, reference: str = IMAGE) -> bool:
    """Traefik alone in an empty image (cluster/images.py); True when it was built."""
    return binary_image(
        binary,
        reference,
        path="/traefik",
        user=IMAGE_USER,
        ports=[f"{WEB_PORT}/tcp", f"{PING_PORT}/tcp"],
        labels={
            "org.opencontainers.image.title": NAME,
            "org.opencontainers.image.version": TRAEFIK_VERSION,
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    return addon_main(
        argv,
        prog="python -m cluster.ingress",
        what="ingress controller",
        image=IMAGE,
        build_image=lambda reference: build_image(reference=reference),
        manifests=manifests,
    )


if __name__ == "__main__":
    sys.exit(main())
