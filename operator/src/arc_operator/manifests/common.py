"""What the serving and the router children share: names and labels, the port, the API key's
environment variable and the hardened container and pod they both run as.

Every helper builds new objects on each call: a manifest never shares a dict or list with
another part of itself (YAML would print the repeat as an alias).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from arc_operator import GROUP
from arc_operator.models import ServingPolicySpec, Toleration
from arc_serving_common.names import API_KEY_ENV

# Both the serving pods and the router serve their API on 8000.
PORT = 8000
PORT_NAME = "http"
HEALTH_PATH = "/health"
# The pod's own emptyDir, mounted there: nothing else shares it (bandit's B108 is about shared
# /tmp on a host).
TMP_DIR = "/tmp"  # nosec B108
# vLLM and the router listen on every pod address: the Services, the probes and the operator's
# scrapes reach them there; the NetworkPolicies limit who may connect (bandit's B104).
LISTEN_ALL = "0.0.0.0"  # nosec B104
POLICY_LABEL = f"{GROUP}/servingpolicy"
ENGINE_NAME = "arc-serving-engine"
ROUTER_NAME = "arc-serving-router"
MANAGED_BY = "arc-serving-operator"
COMPONENT_LABEL = "app.kubernetes.io/component"
SERVING_COMPONENT = "serving"
ROUTER_COMPONENT = "router"
# vLLM's KV event publisher (kv_aware routing): live events, and the replay socket a
# subscriber asks for what it missed. Topic "" (every event), the router's default filter.
KV_EVENTS_PORT, KV_EVENTS_PORT_NAME = 5557, "kv-events"
KV_REPLAY_PORT, KV_REPLAY_PORT_NAME = 5558, "kv-replay"
# A leaving pod's time after its drain, before the kubelet's SIGKILL: vLLM's engine teardown
# and HTTP server stop, or the router's, after the last request has finished.
EXIT_MARGIN_S = 10
BUDGET_API_VERSION, BUDGET_KIND = "policy/v1", "PodDisruptionBudget"


@dataclass(frozen=True, order=True, slots=True)
class Endpoint:
    """A ready serving pod as the router reaches it; sorts by pod name."""

    pod: str
    ip: str

    def url(self, port: int, scheme: str) -> str:
        """``scheme://ip:port``, an IPv6 address in brackets."""
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{scheme}://{host}:{port}"


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


def tcp(*ports: int) -> list[dict[str, Any]]:
    """NetworkPolicy ports."""
    return [{"port": port, "protocol": "TCP"} for port in ports]


def api_key_env(spec: ServingPolicySpec) -> list[dict[str, Any]]:
    """``VLLM_API_KEY`` from the spec's Secret, or nothing without one.

    The kubelet resolves the reference at container start: the key is never in the pod spec,
    the args or a ConfigMap, and the operator needs no access to Secrets.
    """
    ref = spec.api_key_secret_ref
    if ref is None:
        return []
    secret = {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": False}}
    return [{"name": API_KEY_ENV, "valueFrom": secret}]


def probe(period: int, failures: int) -> dict[str, Any]:
    """``GET /health`` on the API port."""
    return {
        "httpGet": {"path": HEALTH_PATH, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def grace_period(spec: ServingPolicySpec) -> int:
    """A pod's terminationGracePeriodSeconds: the preStop wait's bound, the worst-case request
    its drain may still hold, and EXIT_MARGIN_S to exit, so that no held request is killed."""
    return spec.disruption.drain_delay_seconds + spec.request_seconds + EXIT_MARGIN_S


def hardened_container(
    *,
    name: str,
    image: str,
    command: list[str],
    args: list[str],
    env: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    startup_probe: dict[str, Any],
    pre_stop: list[str],
    resources: dict[str, Any],
    volume_mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    """A container with the API's readiness and liveness probes, whose ``pre_stop`` command
    runs before it gets SIGTERM, that cannot write its root filesystem, gain privileges or use
    any capability."""
    return {
        "name": name,
        "image": image,
        "command": command,
        "args": args,
        "env": env,
        "ports": ports,
        "startupProbe": startup_probe,
        "readinessProbe": probe(period=5, failures=3),
        "livenessProbe": probe(period=10, failures=3),
        "lifecycle": {"preStop": {"exec": {"command": pre_stop}}},
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": volume_mounts,
    }


def pod_security_context(run_as: int) -> dict[str, Any]:
    """Non-root as ``run_as`` (uid and gid), emptyDirs and projected files group-owned by it,
    the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": run_as,
        "runAsGroup": run_as,
        "fsGroup": run_as,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def placement(
    node_selector: Mapping[str, str], tolerations: Sequence[Toleration]
) -> dict[str, Any]:
    """A pod spec's ``nodeSelector`` and ``tolerations``, each left out when empty: a spec that
    sets neither gives the pod spec it gave before they existed, so no pod rolls for them."""
    fields: dict[str, Any] = {}
    if node_selector:
        fields["nodeSelector"] = dict(node_selector)
    if tolerations:
        fields["tolerations"] = [
            toleration.model_dump(mode="json", by_alias=True, exclude_none=True)
            for toleration in tolerations
        ]
    return fields


def disruption_budget(
    metadata: dict[str, Any], selector: dict[str, str], max_unavailable: int
) -> dict[str, Any]:
    """A PodDisruptionBudget: voluntary disruptions (drains, evictions) take at most
    ``max_unavailable`` of the selected pods at once."""
    return {
        "apiVersion": BUDGET_API_VERSION,
        "kind": BUDGET_KIND,
        "metadata": metadata,
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": selector}},
    }


def rolling_deployment(
    metadata: dict[str, Any],
    replicas: int,
    selector: dict[str, str],
    template: dict[str, Any],
) -> dict[str, Any]:
    """A Deployment whose rolling updates start a new pod before stopping an old one
    (maxUnavailable 0), so a ready pod always serves: a rollout never takes capacity below
    ``replicas``, more than any disruption budget (at least 1 unavailable) allows."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": template,
        },
    }
