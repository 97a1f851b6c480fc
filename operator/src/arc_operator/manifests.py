"""Manifests of a ServingPolicy's children, as pure functions of (name, namespace, spec) and,
for the NetworkPolicy, the peers the operator is configured to let in.

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
"""

from __future__ import annotations

import json
from typing import Any

from arc_operator import GROUP
from arc_operator.models import API_KEY_ENV, NO_TELEMETRY_ENV, ServingPolicySpec, SwitchMode

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


def config_map_name(name: str) -> str:
    """The policy ConfigMap's name for ServingPolicy ``name``."""
    return f"{name}-policy"


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the pods of ServingPolicy ``name`` (immutable once created)."""
    return {"app.kubernetes.io/name": ENGINE_NAME, "app.kubernetes.io/instance": name}


def labels(name: str) -> dict[str, str]:
    """Labels on every child and on the pods."""
    return {
        **selector_labels(name),
        "app.kubernetes.io/managed-by": MANAGED_BY,
        POLICY_LABEL: name,
    }


def _metadata(name: str, namespace: str, owner: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(owner)}


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


def network_policy(name: str, namespace: str, peers: list[dict[str, Any]]) -> dict[str, Any]:
    """Ingress to the pods of ServingPolicy ``name``: port 8000 only, only from ``peers``.

    No peers means no rule, so nothing may connect (kubelet probes come from the node and are
    not subject to NetworkPolicy). Egress stays open: a pod may download its model.
    """
    ingress = [{"ports": [{"port": PORT, "protocol": "TCP"}], "from": peers}] if peers else []
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
    """vLLM's command-line arguments: the owned ones from the spec, then engineArgs."""
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
    return [*args, "--max-model-len", str(spec.max_model_len), *spec.engine_args]


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
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
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
        "metadata": {"labels": labels(name)},
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
    name: str, namespace: str, spec: ServingPolicySpec, peers: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Every child in apply order: the Deployment first; a NetworkPolicy admitting ``peers``
    unless ``peers`` is None (the operator's network policy setting is off).

    The Deployment is the child the API server may reject for what the spec holds
    (resources, env, image); going first, a rejected spec leaves the running pods' policy
    ConfigMap as it was. A new Deployment's pods wait for their ConfigMap volume, which
    follows at once.
    """
    policy = [] if peers is None else [network_policy(name, namespace, peers)]
    return [
        deployment(name, namespace, spec),
        service(name, namespace, spec),
        *policy,
        config_map(name, namespace, spec),
    ]
