"""Manifests of a ServingPolicy's children, as pure functions of (name, namespace, spec) and,
for the NetworkPolicies, the peers the operator is configured to let in; the router's are
functions of the ready serving pods' endpoints too.

Nothing here reads the cluster or the clock: the same spec always gives the same objects,
which is what makes reconciliation idempotent and lets tests validate the objects against
the Kubernetes schemas. Ownership (``ownerReferences``) is added by the handler with
``kopf.adopt``, since it needs the live object's uid.

The ConfigMap ``NAME-policy`` (``policy.json``) always holds the spec's policy. With
``switchMode: Hot`` the pods mount it (``ARC_EVICTOR_CONFIG``) and the pod template does not
mention the policy, so a policy change rewrites only the ConfigMap and the plugin switches
live. With ``Restart`` the pods do not mount it: the template carries the policy in
``ARC_EVICTOR_POLICY``, so a policy change is a template change, the Deployment rolls
(maxUnavailable 0: old pods serve until new ones are ready), and each old pod keeps its
policy until it is replaced.

Routing (docs/architecture.md, "Routing"): with a routing policy other than none,
``router_children`` adds the vLLM router: Deployment and Service ``NAME-router``, its
ServiceAccount, and for the discovery policies a Role and RoleBinding that let it watch the
serving pods. kv_aware routers get static workers instead (one per ready serving pod, sorted
by pod name, each with its KV event and replay endpoints): that Deployment is a function of
(spec, ready endpoints), re-applied when the ready set changes, with 0 replicas while none is
ready. Router pods carry their own ``app.kubernetes.io/name`` (``ROUTER_NAME``), so the
serving Deployment's selector, fixed when it was created, never matches them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arc_operator import GROUP
from arc_operator.models import (
    API_KEY_ENV,
    NO_TELEMETRY_ENV,
    RoutingPolicy,
    ServingPolicySpec,
    SwitchMode,
)

CONTAINER = "vllm"
PORT = 8000
PORT_NAME = "http"
HEALTH_PATH = "/health"
CONFIG_DIR = "/etc/arc-evictor"
CONFIG_KEY = "policy.json"
CONFIG_ENV = "ARC_EVICTOR_CONFIG"
POLICY_ENV = "ARC_EVICTOR_POLICY"
# The plugin's arc_evictor_* metrics are written by the engine-core process and reach the
# API server's /metrics only through prometheus_client's multiprocess files: an emptyDir,
# fresh at every pod start as vLLM wants.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
METRICS_DIR = "/var/run/arc-evictor/prometheus"
# The serving images' user (images/vllm.Dockerfile, vllm-cpu.Dockerfile): uid and gid 10001.
RUN_AS = 10001
# The root filesystem is read-only. vLLM writes its caches under HOME (torch.compile, triton,
# model info and usage stats under ~/.cache/vllm, ~/.config/vllm, ~/.triton; Hugging Face
# downloads under ~/.cache/huggingface, the images' HF_HOME) and IPC sockets, lock files and
# scratch files under TMPDIR; both are emptyDirs. HOME is the images' home directory, so model
# files baked into an image must live elsewhere (the emptyDir hides what the image has there).
HOME_DIR = "/home/vllm"
# The pod's own emptyDir, mounted there: nothing else shares it (bandit's B108 is about shared
# /tmp on a host).
TMP_DIR = "/tmp"  # nosec B108
# Every variable that decides where those files go, set explicitly so that an image's own ENV
# (another base image, another user) cannot point vLLM at the read-only root.
WRITABLE_DIRS_ENV = {
    "HOME": HOME_DIR,
    "XDG_CACHE_HOME": f"{HOME_DIR}/.cache",
    "XDG_CONFIG_HOME": f"{HOME_DIR}/.config",
    "TMPDIR": TMP_DIR,
}
# emptyDir caps (kubelet evicts a pod that exceeds one). HOME's is the spec's
# resources.homeSizeLimit: a model downloaded from the Hub lands there and its size is the
# model's. Canonical quantity forms, the ones the API server stores, so the live object reads
# as written here.
TMP_SIZE_LIMIT = "2Gi"
METRICS_SIZE_LIMIT = "256Mi"
# vLLM's processes exchange tensors and messages here: the pod's memory-backed emptyDir.
SHM_DIR = "/dev/shm"  # nosec B108
# vLLM listens on every pod address: the Service, the probes and the operator's scrapes reach it
# there; the chart's NetworkPolicy limits who may connect (bandit's B104).
LISTEN_ALL = "0.0.0.0"  # nosec B104
GPU_RESOURCE = "nvidia.com/gpu"
POLICY_LABEL = f"{GROUP}/servingpolicy"
ENGINE_NAME = "arc-serving-engine"
MANAGED_BY = "arc-serving-operator"
COMPONENT_LABEL = "app.kubernetes.io/component"
SERVING_COMPONENT = "serving"
# vLLM's KV event publisher (kv_aware routing): live events, and the replay socket a
# subscriber asks for what it missed. Topic "" (every event), the router's default filter.
KV_EVENTS_PORT, KV_EVENTS_PORT_NAME = 5557, "kv-events"
KV_REPLAY_PORT, KV_REPLAY_PORT_NAME = 5558, "kv-replay"
KV_EVENTS_CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
    "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
    "topic": "",
}
# The router (vllm-router 0.1.17): its API on 8000 like the serving pods, /metrics on 29000.
ROUTER_NAME = "arc-serving-router"
ROUTER_COMPONENT = "router"
ROUTER_CONTAINER = "router"
ROUTER_METRICS_PORT, ROUTER_METRICS_PORT_NAME = 29000, "metrics"
ROUTER_TMP_SIZE_LIMIT = "256Mi"
# The router image's user (images/router.Dockerfile).
ROUTER_RUN_AS = 10001


@dataclass(frozen=True, order=True, slots=True)
class Endpoint:
    """A ready serving pod as the router reaches it; sorts by pod name."""

    pod: str
    ip: str

    def url(self, port: int, scheme: str) -> str:
        """``scheme://ip:port``, an IPv6 address in brackets."""
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{scheme}://{host}:{port}"


def config_map_name(name: str) -> str:
    """The policy ConfigMap's name for ServingPolicy ``name``."""
    return f"{name}-policy"


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the pods of ServingPolicy ``name`` (immutable once created)."""
    return {"app.kubernetes.io/name": ENGINE_NAME, "app.kubernetes.io/instance": name}


def labels(name: str) -> dict[str, str]:
    """Labels on every serving child and on the serving pods."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POLICY_LABEL: name,
    }


def router_name(name: str) -> str:
    """The name of the router children of ServingPolicy ``name``."""
    return f"{name}-router"


def router_selector_labels(name: str) -> dict[str, str]:
    """Labels that select the router pods of ServingPolicy ``name``."""
    return {"app.kubernetes.io/name": ROUTER_NAME, "app.kubernetes.io/instance": name}


def router_labels(name: str) -> dict[str, str]:
    """Labels on every router child and on the router pods."""
    return {
        **router_selector_labels(name),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POLICY_LABEL: name,
        COMPONENT_LABEL: ROUTER_COMPONENT,
    }


def _metadata(name: str, namespace: str, owner: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(owner)}


def _router_metadata(namespace: str, owner: str) -> dict[str, Any]:
    return {"name": router_name(owner), "namespace": namespace, "labels": router_labels(owner)}


def policy_json(spec: ServingPolicySpec) -> str:
    """The plugin's config file: ``{"policy": "arc"}`` (lower-case policy name)."""
    return json.dumps({"policy": spec.policy_name})


def config_map(name: str, namespace: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """The policy ConfigMap the pods mount at /etc/arc-evictor/."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(config_map_name(name), namespace, name),
        "data": {CONFIG_KEY: policy_json(spec)},
    }


def service(name: str, namespace: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """A ClusterIP Service in front of the vLLM pods (port 8000 named http)."""
    del spec  # the Service does not depend on the spec; the parameter keeps one signature
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME}],
        },
    }


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def _distinct(peers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``peers`` without repeats, in order (a peer may be configured as both kinds)."""
    out: list[dict[str, Any]] = []
    for peer in peers:
        if peer not in out:
            out.append(peer)
    return out


def network_policy(
    name: str,
    namespace: str,
    spec: ServingPolicySpec,
    peers: list[dict[str, Any]],
    monitoring: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Ingress to the serving pods of ServingPolicy ``name``.

    Port 8000 from ``peers`` (the API's clients) when the routing policy is none, from the
    router pods otherwise, and from the ``monitoring`` peers (vLLM serves /metrics there);
    with kv_aware routing, the KV event ports only from the router pods. No peers means no
    rule, so nothing may connect (kubelet probes come from the node and are not subject to
    NetworkPolicy). Egress stays open: a pod may download its model.
    """
    routing = spec.routing_policy
    router = [{"podSelector": {"matchLabels": router_selector_labels(name)}}]
    api = _distinct([*(peers if routing is RoutingPolicy.NONE else router), *monitoring])
    ingress = [{"ports": _tcp(PORT), "from": api}] if api else []
    if routing is RoutingPolicy.KV_AWARE:
        ingress.append({"ports": _tcp(KV_EVENTS_PORT, KV_REPLAY_PORT), "from": router})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, namespace, name),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def engine_args(spec: ServingPolicySpec) -> list[str]:
    """vLLM's command-line arguments: the owned ones from the spec, then engineArgs; with
    kv_aware routing also the KV event publisher and the scale-out endpoints."""
    args = [
        "--host",
        LISTEN_ALL,
        "--port",
        str(PORT),
        "--model",
        spec.model.name,
        "--served-model-name",
        spec.model.served,
        "--block-size",
        str(spec.cache.block_size),
        "--enable-prefix-caching",
    ]
    if spec.cache.num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(spec.cache.num_blocks)]
    else:
        args += ["--gpu-memory-utilization", str(spec.cache.gpu_memory_utilization)]
    args += ["--max-model-len", str(spec.max_model_len)]
    if spec.routing_policy is RoutingPolicy.KV_AWARE:
        events = json.dumps(KV_EVENTS_CONFIG, separators=(",", ":"))
        args += ["--kv-events-config", events, "--enable-scale-out"]
    return [*args, *spec.engine_args]


def _resources(spec: ServingPolicySpec) -> dict[str, Any]:
    """Requests equal limits (Guaranteed QoS): cpu and memory always, from the spec or its
    defaults, so a serving pod never runs unbounded."""
    requests = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    limits = dict(requests)
    if spec.resources.gpus:
        # Extended resources are set as limits; Kubernetes copies them to requests.
        limits[GPU_RESOURCE] = str(spec.resources.gpus)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _hot(spec: ServingPolicySpec) -> bool:
    return spec.switch_mode is SwitchMode.HOT


def _env(spec: ServingPolicySpec) -> list[dict[str, Any]]:
    policy = (
        {"name": CONFIG_ENV, "value": f"{CONFIG_DIR}/{CONFIG_KEY}"}
        if _hot(spec)
        else {"name": POLICY_ENV, "value": spec.policy_name}
    )
    owned = [
        policy,
        {"name": METRICS_DIR_ENV, "value": METRICS_DIR},
        *({"name": key, "value": value} for key, value in NO_TELEMETRY_ENV.items()),
    ]
    if spec.api_key_secret_ref is not None:
        # The kubelet resolves the reference at container start: the key is never in the
        # pod spec, the args or a ConfigMap, and the operator needs no access to Secrets.
        ref = spec.api_key_secret_ref
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": False}}
        owned.append({"name": API_KEY_ENV, "valueFrom": secret})
    return owned + [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]


def _engine_ports(spec: ServingPolicySpec) -> list[dict[str, Any]]:
    ports = [(PORT_NAME, PORT)]
    if spec.routing_policy is RoutingPolicy.KV_AWARE:
        ports += [(KV_EVENTS_PORT_NAME, KV_EVENTS_PORT), (KV_REPLAY_PORT_NAME, KV_REPLAY_PORT)]
    return [{"name": n, "containerPort": port, "protocol": "TCP"} for n, port in ports]


def pod_template(name: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """The pod template; it names the policy only in Restart mode (see the module doc)."""
    # Only Hot pods mount the policy ConfigMap: a mounted file would switch Restart pods live.
    policy_mounts = [{"name": "policy", "mountPath": CONFIG_DIR, "readOnly": True}]
    # A whole-directory mount (not subPath) so kubelet updates reach the pod.
    policy_volumes = [{"name": "policy", "configMap": {"name": config_map_name(name)}}]
    if not _hot(spec):
        policy_mounts, policy_volumes = [], []
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": engine_args(spec),
        "env": [
            *({"name": key, "value": value} for key, value in WRITABLE_DIRS_ENV.items()),
            *_env(spec),
        ],
        "ports": _engine_ports(spec),
        # Loading a model can take minutes: the startup probe holds off liveness until then.
        "startupProbe": _probe(period=10, failures=90),
        "readinessProbe": _probe(period=5, failures=3),
        "livenessProbe": _probe(period=10, failures=3),
        "resources": _resources(spec),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            *policy_mounts,
            {"name": "home", "mountPath": HOME_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
            {"name": "dshm", "mountPath": SHM_DIR},
            {"name": "prometheus", "mountPath": METRICS_DIR},
        ],
    }
    return {
        "metadata": {"labels": {**labels(name), COMPONENT_LABEL: SERVING_COMPONENT}},
        "spec": {
            # Service links would inject VLLM_PORT-style variables that vLLM misreads.
            "enableServiceLinks": False,
            # vLLM never calls the Kubernetes API: no token in the pod to steal.
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS,
                "runAsGroup": RUN_AS,
                # emptyDirs and projected files group-owned by the serving user.
                "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [
                *policy_volumes,
                {"name": "home", "emptyDir": {"sizeLimit": spec.resources.home_size_limit}},
                {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}},
                # vLLM's processes exchange tensors and messages through shared memory.
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "prometheus", "emptyDir": {"sizeLimit": METRICS_SIZE_LIMIT}},
            ],
        },
    }


def deployment(name: str, namespace: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """The vLLM Deployment; rolling updates never take a serving pod away first."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": pod_template(name, spec),
        },
    }


def children(
    name: str,
    namespace: str,
    spec: ServingPolicySpec,
    peers: list[dict[str, Any]] | None,
    monitoring: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Every serving child in apply order: the Deployment first; a NetworkPolicy (see
    ``network_policy``) unless ``peers`` is None (the operator's network policy setting is
    off). The router's children come from ``router_children``.

    The Deployment is the child the API server may reject for what the spec holds
    (resources, env, image); going first, a rejected spec leaves the running pods' policy
    ConfigMap as it was. A new Deployment's pods wait for their ConfigMap volume, which
    follows at once.
    """
    policy = [] if peers is None else [network_policy(name, namespace, spec, peers, monitoring)]
    return [
        deployment(name, namespace, spec),
        service(name, namespace, spec),
        *policy,
        config_map(name, namespace, spec),
    ]


# --- the router -------------------------------------------------------------------------------


def router_args(
    name: str, namespace: str, spec: ServingPolicySpec, endpoints: Sequence[Endpoint]
) -> list[str]:
    """The router's arguments: the owned ones, then routing.args.

    kv_aware: static workers, the ``endpoints`` in the order given, each with its KV event and
    replay sockets, hashed at cache.blockSize under the served model name (the router cannot
    tell a mismatch: it would silently find no prefix). Other policies: Kubernetes service
    discovery of this ServingPolicy's serving pods. The API key stays in the Secret: Kubernetes
    expands ``$(VLLM_API_KEY)`` from the container's env when it starts the container.
    """
    policy = spec.routing_policy
    args = [
        "--host", LISTEN_ALL, "--port", str(PORT),
        "--prometheus-host", LISTEN_ALL, "--prometheus-port", str(ROUTER_METRICS_PORT),
        "--policy", policy.value,
    ]  # fmt: skip
    if policy is RoutingPolicy.KV_AWARE:
        workers = [endpoint.url(PORT, "http") for endpoint in endpoints]
        if workers:
            args += ["--worker-urls", *workers]
        for worker, endpoint in zip(workers, endpoints, strict=True):
            args += ["--kv-event-source", f"{worker}={endpoint.url(KV_EVENTS_PORT, 'tcp')}"]
        for worker, endpoint in zip(workers, endpoints, strict=True):
            args += [
                "--kv-event-replay-source",
                f"{worker}={endpoint.url(KV_REPLAY_PORT, 'tcp')}",
            ]
        args += [
            "--kv-event-block-size", str(spec.cache.block_size),
            "--kv-event-model", spec.model.served,
        ]  # fmt: skip
    else:
        args += [
            "--service-discovery",
            "--selector", f"{POLICY_LABEL}={name}", f"{COMPONENT_LABEL}={SERVING_COMPONENT}",
            "--service-discovery-namespace", namespace,
            "--service-discovery-port", str(PORT),
        ]  # fmt: skip
    if spec.api_key_secret_ref is not None:
        # One token: a key that starts with "-" would otherwise read as an option.
        args += [f"--api-key=$({API_KEY_ENV})"]
    return [*args, *spec.routing.args]


def _discovers(spec: ServingPolicySpec) -> bool:
    """Whether the router finds its workers through the Kubernetes API (not kv_aware)."""
    return spec.routing_policy is not RoutingPolicy.KV_AWARE


def router_replicas(spec: ServingPolicySpec, endpoints: Sequence[Endpoint]) -> int:
    """routing.replicas; 0 for a kv_aware router with no ready serving pod, which has no
    worker to start with (the router refuses to start before its static workers are healthy)."""
    if spec.routing_policy is RoutingPolicy.KV_AWARE and not endpoints:
        return 0
    return spec.routing.replicas


def _router_probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def router_pod_template(
    name: str, namespace: str, spec: ServingPolicySpec, endpoints: Sequence[Endpoint], image: str
) -> dict[str, Any]:
    """The router pod: non-root, read-only root filesystem, no capabilities, /tmp an emptyDir;
    a service-account token only where it discovers its workers through the API."""
    requests = {"cpu": spec.routing.resources.cpu, "memory": spec.routing.resources.memory}
    env = [{"name": "HOME", "value": TMP_DIR}, {"name": "TMPDIR", "value": TMP_DIR}]
    if spec.api_key_secret_ref is not None:
        ref = spec.api_key_secret_ref
        secret = {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": False}}
        env.append({"name": API_KEY_ENV, "valueFrom": secret})
    container = {
        "name": ROUTER_CONTAINER,
        "image": image,
        "command": ["vllm-router"],
        "args": router_args(name, namespace, spec, endpoints),
        "env": env,
        "ports": [
            {"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"},
            {
                "name": ROUTER_METRICS_PORT_NAME,
                "containerPort": ROUTER_METRICS_PORT,
                "protocol": "TCP",
            },
        ],
        # Static workers must be healthy before the router listens: the startup probe waits.
        "startupProbe": _router_probe(period=5, failures=60),
        "readinessProbe": _router_probe(period=5, failures=3),
        "livenessProbe": _router_probe(period=10, failures=3),
        "resources": {"requests": requests, "limits": dict(requests)},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_DIR}],
    }
    return {
        "metadata": {"labels": router_labels(name)},
        "spec": {
            "serviceAccountName": router_name(name),
            "automountServiceAccountToken": _discovers(spec),
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": ROUTER_RUN_AS,
                "runAsGroup": ROUTER_RUN_AS,
                "fsGroup": ROUTER_RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": ROUTER_TMP_SIZE_LIMIT}}],
        },
    }


def router_deployment(
    name: str, namespace: str, spec: ServingPolicySpec, endpoints: Sequence[Endpoint], image: str
) -> dict[str, Any]:
    """The router Deployment; a new worker set rolls it with a new pod ready before an old
    one stops (maxUnavailable 0), so requests always find a router."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _router_metadata(namespace, name),
        "spec": {
            "replicas": router_replicas(spec, endpoints),
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": router_pod_template(name, namespace, spec, endpoints, image),
        },
    }


def router_service(name: str, namespace: str) -> dict[str, Any]:
    """The ClusterIP Service clients use when routing is on (8000 http, 29000 metrics)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _router_metadata(namespace, name),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(name),
            "ports": [
                {"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME},
                {
                    "name": ROUTER_METRICS_PORT_NAME,
                    "port": ROUTER_METRICS_PORT,
                    "targetPort": ROUTER_METRICS_PORT_NAME,
                },
            ],
        },
    }


def router_service_account(name: str, namespace: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """The router's identity; a kv_aware router calls no API and gets no token."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _router_metadata(namespace, name),
        "automountServiceAccountToken": _discovers(spec),
    }


def router_role(name: str, namespace: str) -> dict[str, Any]:
    """Read the pods of this namespace, which service discovery watches; nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _router_metadata(namespace, name),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }


def router_role_binding(name: str, namespace: str) -> dict[str, Any]:
    """Grant the router's Role to its ServiceAccount."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _router_metadata(namespace, name),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": router_name(name),
        },
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name), "namespace": namespace}],
    }


def router_network_policy(
    name: str,
    namespace: str,
    peers: list[dict[str, Any]],
    monitoring: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Ingress to the router pods: the API port 8000 from ``peers``, /metrics on 29000 from
    the ``monitoring`` peers; nothing else."""
    ingress = []
    if peers:
        ingress.append({"ports": _tcp(PORT), "from": list(peers)})
    if monitoring:
        ingress.append({"ports": _tcp(ROUTER_METRICS_PORT), "from": list(monitoring)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _router_metadata(namespace, name),
        "spec": {
            "podSelector": {"matchLabels": router_selector_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# Every kind of router child, (apiVersion, kind), in apply order; deleting them in reverse
# leaves no Deployment whose ServiceAccount is gone.
ROUTER_KINDS = (
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def router_children(
    name: str,
    namespace: str,
    spec: ServingPolicySpec,
    endpoints: Sequence[Endpoint],
    *,
    image: str,
    peers: list[dict[str, Any]] | None,
    monitoring: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The router's children in apply order (``ROUTER_KINDS``); none when the routing policy
    is none. The ServiceAccount and its grants come before the Deployment whose pods use
    them; a NetworkPolicy unless ``peers`` is None (the network policy setting is off)."""
    if spec.routing_policy is RoutingPolicy.NONE:
        return []
    grants = [] if not _discovers(spec) else [
        router_role(name, namespace),
        router_role_binding(name, namespace),
    ]  # fmt: skip
    policy = [] if peers is None else [router_network_policy(name, namespace, peers, monitoring)]
    return [
        router_service_account(name, namespace, spec),
        *grants,
        router_deployment(name, namespace, spec, endpoints, image),
        router_service(name, namespace),
        *policy,
    ]
