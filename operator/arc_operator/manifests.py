"""Manifests of a ServingPolicy's children, as pure functions of (name, namespace, spec).

Nothing here reads the cluster or the clock: the same spec always gives the same objects,
which is what makes reconciliation idempotent and lets tests validate the objects against
the Kubernetes schemas. Ownership (``ownerReferences``) is added by the handler with
``kopf.adopt``, since it needs the live object's uid.

The policy reaches the pods through the ConfigMap ``NAME-policy`` (``policy.json``). With
``switchMode: Hot`` the pod template does not mention the policy at all, so a policy change
rewrites only the ConfigMap and the plugin switches live. With ``Restart`` the template
carries the policy in an annotation, so a policy change is a template change and the
Deployment rolls (maxUnavailable 0: old pods serve until new ones are ready).
"""

from __future__ import annotations

import json
from typing import Any

from arc_operator import GROUP
from arc_operator.models import ServingPolicySpec, SwitchMode

CONTAINER = "vllm"
PORT = 8000
PORT_NAME = "http"
HEALTH_PATH = "/health"
CONFIG_DIR = "/etc/arc-evictor"
CONFIG_KEY = "policy.json"
CONFIG_ENV = "ARC_EVICTOR_CONFIG"
# The plugin's arc_evictor_* metrics are written by the engine-core process and reach the
# API server's /metrics only through prometheus_client's multiprocess files: an emptyDir,
# fresh at every pod start as vLLM wants.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
METRICS_DIR = "/var/run/arc-evictor/prometheus"
GPU_RESOURCE = "nvidia.com/gpu"
POLICY_ANNOTATION = f"{GROUP}/policy"
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


def engine_args(spec: ServingPolicySpec) -> list[str]:
    """vLLM's command-line arguments: the owned ones from the spec, then engineArgs."""
    args = [
        "--host",
        "0.0.0.0",
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
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = limits["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
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


def _env(spec: ServingPolicySpec) -> list[dict[str, Any]]:
    owned = [
        {"name": CONFIG_ENV, "value": f"{CONFIG_DIR}/{CONFIG_KEY}"},
        {"name": METRICS_DIR_ENV, "value": METRICS_DIR},
    ]
    return owned + [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]


def pod_template(name: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """The pod template; it names the policy only in Restart mode (see the module doc)."""
    metadata: dict[str, Any] = {"labels": labels(name)}
    if spec.switch_mode is SwitchMode.RESTART:
        metadata["annotations"] = {POLICY_ANNOTATION: spec.policy_name}
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": engine_args(spec),
        "env": _env(spec),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        # Loading a model can take minutes: the startup probe holds off liveness until then.
        "startupProbe": _probe(period=10, failures=90),
        "readinessProbe": _probe(period=5, failures=3),
        "livenessProbe": _probe(period=10, failures=3),
        "resources": _resources(spec),
        "volumeMounts": [
            {"name": "policy", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "prometheus", "mountPath": METRICS_DIR},
        ],
    }
    return {
        "metadata": metadata,
        "spec": {
            # Service links would inject VLLM_PORT-style variables that vLLM misreads.
            "enableServiceLinks": False,
            "containers": [container],
            "volumes": [
                # A whole-directory mount (not subPath) so kubelet updates reach the pod.
                {"name": "policy", "configMap": {"name": config_map_name(name)}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "prometheus", "emptyDir": {}},
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


def children(name: str, namespace: str, spec: ServingPolicySpec) -> list[dict[str, Any]]:
    """Every child in apply order: the ConfigMap first, since the pods mount it."""
    return [
        config_map(name, namespace, spec),
        service(name, namespace, spec),
        deployment(name, namespace, spec),
    ]
