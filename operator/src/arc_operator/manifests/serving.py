"""The serving children of a ServingPolicy: the vLLM Deployment, its Service, NetworkPolicy and
policy ConfigMap.

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
from collections.abc import Sequence
from typing import Any

from arc_operator.manifests.common import (
    COMPONENT_LABEL,
    KV_EVENTS_PORT,
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_PORT,
    KV_REPLAY_PORT_NAME,
    LISTEN_ALL,
    PORT,
    PORT_NAME,
    SERVING_COMPONENT,
    TMP_DIR,
    api_key_env,
    disruption_budget,
    grace_period,
    hardened_container,
    labels,
    placement,
    pod_security_context,
    probe,
    rolling_deployment,
    router_selector_labels,
    selector_labels,
    tcp,
)
from arc_operator.models import (
    MODEL_DIR,
    NO_TELEMETRY_ENV,
    OFFLINE_ENV,
    RoutingPolicy,
    ServingPolicySpec,
    SwitchMode,
)
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV, policy_file_text

CONTAINER = "vllm"
CONFIG_DIR = "/etc/arc-evictor"
CONFIG_KEY = "policy.json"
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
GPU_RESOURCE = "nvidia.com/gpu"
KV_EVENTS_CONFIG = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
    "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}",
    "topic": "",
}


# The serving pod's preStop (python3 -c, the images' Python; argv: bound, quiet, metrics URL):
# it waits until no request has arrived for `quiet` seconds, at most `bound` seconds, so that
# the Service endpoints and the router have dropped the pod before vLLM gets SIGTERM. vLLM
# aborts a request that arrives after SIGTERM (a 200 with finish_reason "abort" that no router
# retries); the requests it already holds it drains (--shutdown-timeout). Arrivals are counted
# from vLLM's /metrics as finished + running + waiting requests; an unreachable server counts
# as quiet.
DRAIN_WAIT = """\
import sys, time, urllib.request
bound, quiet, url = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
COUNTED = ("vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting")
def arrivals():
    try:
        text = urllib.request.urlopen(url, timeout=1).read().decode()
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith(COUNTED)]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)
start = since = time.monotonic()
seen = arrivals()
while time.monotonic() - start < bound and time.monotonic() - since < quiet:
    time.sleep(0.25)
    now = arrivals()
    if now != seen:
        seen, since = now, time.monotonic()
"""
DRAIN_QUIET_S = 2


def config_map_name(name: str) -> str:
    """The policy ConfigMap's name for ServingPolicy ``name``."""
    return f"{name}-policy"


def _metadata(name: str, namespace: str, owner: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(owner)}


def policy_json(spec: ServingPolicySpec) -> str:
    """The plugin's config file: ``{"policy": "arc"}`` (lower-case policy name)."""
    return policy_file_text(spec.policy_name)


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
    ingress = [{"ports": tcp(PORT), "from": api}] if api else []
    if routing is RoutingPolicy.KV_AWARE:
        ingress.append({"ports": tcp(KV_EVENTS_PORT, KV_REPLAY_PORT), "from": router})
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
    # Drain mode: on SIGTERM vLLM finishes the requests it holds, for at most this long.
    args += ["--shutdown-timeout", str(spec.request_seconds)]
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
        *api_key_env(spec),
        *({"name": key, "value": value} for key, value in OFFLINE_ENV.items() if spec.model.volume),
    ]
    return owned + [var.model_dump(by_alias=True, exclude_none=True) for var in spec.env]


def _engine_ports(spec: ServingPolicySpec) -> list[dict[str, Any]]:
    ports = [(PORT_NAME, PORT)]
    if spec.routing_policy is RoutingPolicy.KV_AWARE:
        ports += [(KV_EVENTS_PORT_NAME, KV_EVENTS_PORT), (KV_REPLAY_PORT_NAME, KV_REPLAY_PORT)]
    return [{"name": n, "containerPort": port, "protocol": "TCP"} for n, port in ports]


def _model_volume(spec: ServingPolicySpec) -> list[dict[str, Any]]:
    """The model's volume, if the spec names one: read-only at the source as well as at the
    mount, and a hostPath must already be a directory (the kubelet never creates it)."""
    volume = spec.model.volume
    if volume is not None and volume.persistent_volume_claim is not None:
        claim = volume.persistent_volume_claim.claim_name
        source = {"persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    elif volume is not None and volume.host_path is not None:
        source = {"hostPath": {"path": volume.host_path.path, "type": "Directory"}}
    else:
        return []
    return [{"name": "model", **source}]


def _drain_wait(spec: ServingPolicySpec) -> list[str]:
    """The preStop command: DRAIN_WAIT on this pod's own /metrics."""
    bound = str(spec.disruption.drain_delay_seconds)
    return [
        "python3",
        "-c",
        DRAIN_WAIT,
        bound,
        str(DRAIN_QUIET_S),
        f"http://127.0.0.1:{PORT}/metrics",
    ]


def pod_template(name: str, spec: ServingPolicySpec) -> dict[str, Any]:
    """The pod template; it names the policy only in Restart mode (see the module doc)."""
    # Only Hot pods mount the policy ConfigMap: a mounted file would switch Restart pods live.
    policy_mounts = [{"name": "policy", "mountPath": CONFIG_DIR, "readOnly": True}]
    # A whole-directory mount (not subPath) so kubelet updates reach the pod.
    policy_volumes = [{"name": "policy", "configMap": {"name": config_map_name(name)}}]
    if not _hot(spec):
        policy_mounts, policy_volumes = [], []
    model_volumes = _model_volume(spec)
    model_mounts = (
        [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}] if model_volumes else []
    )
    container = hardened_container(
        name=CONTAINER,
        image=spec.image,
        command=["python3", "-m", "vllm.entrypoints.openai.api_server"],
        args=engine_args(spec),
        env=[
            *({"name": key, "value": value} for key, value in WRITABLE_DIRS_ENV.items()),
            *_env(spec),
        ],
        ports=_engine_ports(spec),
        # Loading a model can take minutes: the startup probe holds off liveness until then.
        startup_probe=probe(period=10, failures=90),
        pre_stop=_drain_wait(spec),
        resources=_resources(spec),
        volume_mounts=[
            *policy_mounts,
            *model_mounts,
            {"name": "home", "mountPath": HOME_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
            {"name": "dshm", "mountPath": SHM_DIR},
            {"name": "prometheus", "mountPath": METRICS_DIR},
        ],
    )
    return {
        "metadata": {"labels": {**labels(name), COMPONENT_LABEL: SERVING_COMPONENT}},
        "spec": {
            # Service links would inject VLLM_PORT-style variables that vLLM misreads.
            "enableServiceLinks": False,
            # vLLM never calls the Kubernetes API: no token in the pod to steal.
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": grace_period(spec),
            "securityContext": pod_security_context(RUN_AS),
            **placement(spec.node_selector, spec.tolerations),
            "containers": [container],
            "volumes": [
                *policy_volumes,
                *model_volumes,
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
    return rolling_deployment(
        _metadata(name, namespace, name),
        spec.replicas,
        selector_labels(name),
        pod_template(name, spec),
    )


def budgets(name: str, namespace: str, spec: ServingPolicySpec) -> list[dict[str, Any]]:
    """The serving pods' PodDisruptionBudget (disruption.maxUnavailable); none with at most
    one replica, where any budget would either block every node drain or allow everything."""
    if spec.replicas <= 1:
        return []
    metadata = _metadata(name, namespace, name)
    return [disruption_budget(metadata, selector_labels(name), spec.disruption.max_unavailable)]


def children(
    name: str,
    namespace: str,
    spec: ServingPolicySpec,
    peers: list[dict[str, Any]] | None,
    monitoring: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Every serving child in apply order: the Deployment first; a NetworkPolicy (see
    ``network_policy``) unless ``peers`` is None (the operator's network policy setting is
    off). The router's children come from ``router.router_children``.

    The Deployment is the child the API server may reject for what the spec holds
    (resources, env, image); going first, a rejected spec leaves the running pods' policy
    ConfigMap as it was. A new Deployment's pods wait for their ConfigMap volume, which
    follows at once. A PodDisruptionBudget (``budgets``) comes last, with more than one replica.
    """
    policy = [] if peers is None else [network_policy(name, namespace, spec, peers, monitoring)]
    return [
        deployment(name, namespace, spec),
        service(name, namespace, spec),
        *policy,
        config_map(name, namespace, spec),
        *budgets(name, namespace, spec),
    ]
