"""The router children of a ServingPolicy (docs/architecture.md, "Routing").

With a routing policy other than none, ``router_children`` adds the vLLM router: Deployment and
Service ``NAME-router``, its ServiceAccount, and for the discovery policies a Role and
RoleBinding that let it watch the serving pods. kv_aware routers get static workers instead
(one per ready serving pod, sorted by pod name, each with its KV event and replay endpoints):
that Deployment is a function of (spec, ready endpoints), re-applied when the ready set
changes, with 0 replicas while none is ready. Router pods carry their own
``app.kubernetes.io/name`` (``ROUTER_NAME``), so the serving Deployment's selector, fixed when
it was created, never matches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arc_operator.manifests.common import (
    COMPONENT_LABEL,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    LISTEN_ALL,
    POLICY_LABEL,
    PORT,
    PORT_NAME,
    SERVING_COMPONENT,
    TMP_DIR,
    Endpoint,
    api_key_env,
    disruption_budget,
    grace_period,
    hardened_container,
    placement,
    pod_security_context,
    probe,
    rolling_deployment,
    router_labels,
    router_name,
    router_selector_labels,
    tcp,
)
from arc_operator.models import (
    DEFAULT_KV_AWARE_TEMPERATURE,
    ROUTER_TEMPERATURE,
    RoutingPolicy,
    ServingPolicySpec,
    router_arg,
)
from arc_serving_common.names import API_KEY_ENV

# The router (vllm-router 0.1.17): its API on 8000 like the serving pods, /metrics on 29000.
ROUTER_CONTAINER = "router"
ROUTER_METRICS_PORT, ROUTER_METRICS_PORT_NAME = 29000, "metrics"
ROUTER_TMP_SIZE_LIMIT = "256Mi"
# The router image's user (images/router.Dockerfile).
ROUTER_RUN_AS = 10001
# Retries and circuit breaker, unless routing.args sets them (docs/operator.md, "Disruptions").
# The router retries a request whose worker answered 408, 429, 500, 502, 503 or 504, or refused
# the connection (a 500), before it sends the client anything, choosing the worker again each
# time among those whose circuit is closed. Two failures open a worker's circuit, so a leaving
# pod that kv_aware would choose again (it holds the prefix) is skipped from the third attempt
# on; after 5 s one success closes it again, so a pod tripped by a passing error is soon back.
ROUTER_RESILIENCE = (
    ("--retry-max-retries", "5"),
    ("--cb-failure-threshold", "2"),
    ("--cb-success-threshold", "1"),
    ("--cb-timeout-duration-secs", "5"),
)


def _router_metadata(namespace: str, owner: str) -> dict[str, Any]:
    return {"name": router_name(owner), "namespace": namespace, "labels": router_labels(owner)}


def router_args(
    name: str, namespace: str, spec: ServingPolicySpec, endpoints: Sequence[Endpoint]
) -> list[str]:
    """The router's arguments: the owned ones, ROUTER_RESILIENCE's where routing.args sets
    none, then routing.args.

    kv_aware: static workers, the ``endpoints`` in the order given, each with its KV event and
    replay sockets, hashed at cache.blockSize under the served model name (the router cannot
    tell a mismatch: it would silently find no prefix), and ``--router-temperature
    DEFAULT_KV_AWARE_TEMPERATURE`` unless routing.args sets one. Other policies: Kubernetes service
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
        if router_arg(spec.routing.args, ROUTER_TEMPERATURE) is None:
            args += [ROUTER_TEMPERATURE, DEFAULT_KV_AWARE_TEMPERATURE]
    else:
        args += [
            "--service-discovery",
            "--selector", f"{POLICY_LABEL}={name}", f"{COMPONENT_LABEL}={SERVING_COMPONENT}",
            "--service-discovery-namespace", namespace,
            "--service-discovery-port", str(PORT),
        ]  # fmt: skip
    for flag, value in ROUTER_RESILIENCE:
        if router_arg(spec.routing.args, flag) is None:
            args += [flag, value]
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


def router_pod_template(
    name: str, namespace: str, spec: ServingPolicySpec, endpoints: Sequence[Endpoint], image: str
) -> dict[str, Any]:
    """The router pod: non-root, read-only root filesystem, no capabilities, /tmp an emptyDir;
    a service-account token only where it discovers its workers through the API."""
    requests = {"cpu": spec.routing.resources.cpu, "memory": spec.routing.resources.memory}
    container = hardened_container(
        name=ROUTER_CONTAINER,
        image=image,
        command=["vllm-router"],
        args=router_args(name, namespace, spec, endpoints),
        env=[
            {"name": "HOME", "value": TMP_DIR},
            {"name": "TMPDIR", "value": TMP_DIR},
            *api_key_env(spec),
        ],
        ports=[
            {"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"},
            {
                "name": ROUTER_METRICS_PORT_NAME,
                "containerPort": ROUTER_METRICS_PORT,
                "protocol": "TCP",
            },
        ],
        # Static workers must be healthy before the router listens: the startup probe waits.
        startup_probe=probe(period=5, failures=60),
        # The Service drops a terminating pod within a second or two; then SIGTERM, on which
        # the router stops accepting and finishes the requests it holds (axum's graceful
        # shutdown: "Received terminate signal, starting graceful shutdown").
        pre_stop=["sleep", str(spec.disruption.drain_delay_seconds)],
        resources={"requests": requests, "limits": dict(requests)},
        volume_mounts=[{"name": "tmp", "mountPath": TMP_DIR}],
    )
    return {
        "metadata": {"labels": router_labels(name)},
        "spec": {
            "serviceAccountName": router_name(name),
            "automountServiceAccountToken": _discovers(spec),
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_period(spec),
            "securityContext": pod_security_context(ROUTER_RUN_AS),
            # Its own placement, never the vLLM pods' (docs/architecture.md, "Routing").
            **placement(spec.routing.node_selector, spec.routing.tolerations),
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": ROUTER_TMP_SIZE_LIMIT}}],
        },
    }


def router_deployment(
    name: str, namespace: str, spec: ServingPolicySpec, endpoints: Sequence[Endpoint], image: str
) -> dict[str, Any]:
    """The router Deployment; a new worker set rolls it with a new pod ready before an old
    one stops (maxUnavailable 0), so requests always find a router."""
    return rolling_deployment(
        _router_metadata(namespace, name),
        router_replicas(spec, endpoints),
        router_selector_labels(name),
        router_pod_template(name, namespace, spec, endpoints, image),
    )


def router_budgets(name: str, namespace: str, spec: ServingPolicySpec) -> list[dict[str, Any]]:
    """The router pods' PodDisruptionBudget (one at a time); none with one router."""
    if spec.routing.replicas <= 1:
        return []
    metadata = _router_metadata(namespace, name)
    return [disruption_budget(metadata, router_selector_labels(name), max_unavailable=1)]


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
        ingress.append({"ports": tcp(PORT), "from": list(peers)})
    if monitoring:
        ingress.append({"ports": tcp(ROUTER_METRICS_PORT), "from": list(monitoring)})
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
    them; a NetworkPolicy unless ``peers`` is None (the network policy setting is off); a
    PodDisruptionBudget with more than one router (``router_budgets``), which the reconcile's
    budget pass deletes, not ``ROUTER_KINDS``'s."""
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
        *router_budgets(name, namespace, spec),
    ]
