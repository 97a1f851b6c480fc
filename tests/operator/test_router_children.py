"""Pure tests of routing: spec.routing's validation, the router's children, and the router
flags checked against the real vllm-router 0.1.17 (its parser, and one start for the block
size limit). docs/architecture.md, "Routing", is the contract."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
from vllm_router.launch_router import parse_router_args
from vllm_router.router_args import RouterArgs

from arc_operator import manifests
from arc_operator.models import DEFAULT_FLEET_ROUTING, OperatorConfig, RoutingPolicy, SpecError
from arc_operator.models import parse_spec as parse
from arc_operator.models.spec import (
    CONFLICTING_ROUTER_ARGS,
    OWNED_ROUTER_ARGS,
    ROUTER_MAX_BLOCK_SIZE,
)
from tests.operator.conftest import make_spec

K8S_VERSION = "1.33"
PEERS = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "ingress"}}}]
MONITORING = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "prometheus"}}}]
ENDPOINTS = (
    manifests.Endpoint("demo-7d9-a", "10.0.0.7"),
    manifests.Endpoint("demo-7d9-b", "fd00::8"),
)
IMAGE = "ghcr.io/arc-serving/router:0.1.0"
DISCOVERY = [p for p in RoutingPolicy if p not in {RoutingPolicy.NONE, RoutingPolicy.KV_AWARE}]
ROUTERS = [RoutingPolicy.KV_AWARE, *DISCOVERY]


def routed(
    policy: RoutingPolicy | str, routing: dict[str, Any] | None = None, **overrides: Any
) -> dict[str, Any]:
    """A valid spec with two replicas and ``policy`` routing (plus ``routing``'s fields)."""
    return make_spec(replicas=2, routing={"policy": str(policy), **(routing or {})}, **overrides)


def router_children(spec: dict[str, Any], endpoints=ENDPOINTS) -> dict[str, dict[str, Any]]:
    children = manifests.router_children(
        "demo", "serving", parse(spec), endpoints, image=IMAGE, peers=PEERS, monitoring=MONITORING
    )
    return {child["kind"]: child for child in children}


def router_container(spec: dict[str, Any], endpoints=ENDPOINTS) -> dict[str, Any]:
    deployment = router_children(spec, endpoints)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- spec.routing ---------------------------------------------------------------------------


def test_routing_defaults_to_the_fleet_policy_with_more_than_one_replica() -> None:
    assert DEFAULT_FLEET_ROUTING is RoutingPolicy.KV_AWARE
    assert parse(make_spec(replicas=1)).routing_policy is RoutingPolicy.NONE
    assert parse(make_spec(replicas=0)).routing_policy is RoutingPolicy.NONE
    assert parse(make_spec(replicas=2)).routing_policy is DEFAULT_FLEET_ROUTING
    assert parse(routed("round_robin")).routing_policy is RoutingPolicy.ROUND_ROBIN
    assert parse(make_spec(replicas=1, routing={"policy": "kv_aware"})).routing_policy is (
        RoutingPolicy.KV_AWARE
    )
    routing = parse(make_spec()).routing
    assert (routing.replicas, routing.resources.cpu, routing.resources.memory) == (1, "1", "1Gi")
    assert (routing.image, routing.args) == (None, [])


def test_routing_policies_are_the_routers_choices() -> None:
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    (policy,) = [a for a in parser._actions if "--policy" in a.option_strings]
    assert {p.value for p in RoutingPolicy} - {"none"} == set(policy.choices)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            {"routing": {"policy": "fastest"}},
            "spec.routing.policy: Input should be 'none', 'round_robin', 'random', "
            "'consistent_hash', 'power_of_two', 'cache_aware', 'kv_aware' or "
            "'sticky_least_loaded'",
        ),
        (
            {"routing": {"replicas": 0}},
            "spec.routing.replicas: Input should be greater than or equal to 1",
        ),
        ({"routing": {"resources": {"cpu": "one"}}}, "spec.routing.resources.cpu: String"),
        ({"routing": {"image": ""}}, "spec.routing.image: String should have at least 1"),
        ({"routing": {"color": "red"}}, "spec.routing.color: Extra inputs are not permitted"),
        ({"routing": {"args": ["--port", "9000"]}}, "routing.args may not set --port"),
        ({"routing": {"args": ["--policy=random"]}}, "routing.args may not set --policy"),
        # argparse takes any unambiguous prefix.
        ({"routing": {"args": ["--kv-event-bl", "32"]}}, "may not set --kv-event-block-size"),
        ({"routing": {"args": ["--worker-urls", "http://x"]}}, "may not set --worker-urls"),
        ({"routing": {"args": ["--selector", "a=b"]}}, "routing.args may not set --selector"),
        ({"routing": {"args": ["--prometheus-port=1"]}}, "may not set --prometheus-port"),
        ({"routing": {"args": ["--api-key", "k"]}}, "routing.args may not set --api-key (the"),
        (
            {"routing": {"args": ["--vllm-pd-disaggregation"]}},
            "routing.args may not set --vllm-pd-disaggregation (another router mode",
        ),
        ({"routing": {"args": ["--prefill", "http://p"]}}, "may not set --prefill (another"),
        ({"routing": {"args": ["--enable-igw"]}}, "routing.args may not set --enable-igw"),
        (
            {"routing": {"args": ["--router-temperature", "-1"]}},
            "routing.args: --router-temperature must be a number >= 0, got '-1'",
        ),
        (
            {"routing": {"args": ["--router-temperature=warm"]}},
            "routing.args: --router-temperature must be a number >= 0, got 'warm'",
        ),
        (
            {"routing": {"args": ["--router-temp", "nan"]}},
            "routing.args: --router-temperature must be a number >= 0, got 'nan'",
        ),
        (
            {"routing": {"args": ["--router-temperature"]}},
            "routing.args: --router-temperature must be a number >= 0, got ''",
        ),
        (
            {"routing": {"args": ["--kv-aware-session-affinity-ttl-secs", "0"]}},
            "routing.args: --kv-aware-session-affinity-ttl-secs must be whole seconds from 1 to "
            "31536000, got '0'",
        ),
        (
            {"routing": {"args": ["--kv-aware-session-affinity=1.5"]}},
            "--kv-aware-session-affinity-ttl-secs must be whole seconds from 1 to 31536000, got "
            "'1.5'",
        ),
        (
            {"routing": {"args": ["--kv-aware-session-affinity-ttl-secs", "31536001"]}},
            "got '31536001'",
        ),
        # kv_aware, named or by default with two replicas.
        (
            {"replicas": 2, "engineArgs": ["--kv-events-config", "{}"]},
            "engineArgs may not set --kv-events-config (set by the operator when "
            "routing.policy is kv_aware)",
        ),
        (
            {"routing": {"policy": "kv_aware"}, "engineArgs": ["--no-enable-scale-out"]},
            "engineArgs may not set --no-enable-scale-out",
        ),
        (
            {"replicas": 2, "engineArgs": ["--no-enable-prefix-caching"]},
            "engineArgs may not set --no-enable-prefix-caching: routing.policy kv_aware routes "
            "by the pods' prefix-cache events",
        ),
        ({"replicas": 2, "engineArgs": ["--block-size", "32"]}, "may not set --block-size"),
        (
            {"replicas": 2, "cache": {"blockSize": 2**32, "numBlocks": 512}},
            "spec.cache.blockSize: Input should be less than or equal to 4294967295",
        ),
    ],
)
def test_invalid_routing_is_rejected_naming_the_problem(changes: dict, problem: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse(make_spec(**changes))
    assert problem in str(caught.value)


def test_kv_flags_are_the_users_without_kv_aware_routing() -> None:
    spec = routed("round_robin", engineArgs=["--kv-events-config", "{}"])
    assert parse(spec).engine_args == ["--kv-events-config", "{}"]


def test_router_args_keep_what_the_operator_does_not_own() -> None:
    spec = parse(routed("cache_aware", routing={"args": ["--cache-threshold", "0.5"]}))
    assert spec.routing.args == ["--cache-threshold", "0.5"]


def test_owned_and_conflicting_flags_are_router_flags_and_no_other_flag_abbreviates_one() -> None:
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    flags = {o for action in parser._actions for o in action.option_strings}
    refused = OWNED_ROUTER_ARGS | CONFLICTING_ROUTER_ARGS
    assert refused <= flags
    # A prefix of a refused flag is refused; no flag the user may set is such a prefix.
    assert not [(f, r) for f in flags - refused for r in refused if r.startswith(f)]


def test_router_image_comes_from_the_spec_or_the_operator() -> None:
    spec = parse(routed("kv_aware"))
    assert OperatorConfig(router_image=IMAGE).router_image_for(spec) == IMAGE
    own = parse(routed("kv_aware", routing={"image": "mine:1"}))
    assert OperatorConfig(router_image=IMAGE).router_image_for(own) == "mine:1"
    with pytest.raises(SpecError, match=r"spec\.routing\.image: .*ARC_OPERATOR_ROUTER_IMAGE"):
        OperatorConfig().router_image_for(spec)
    assert OperatorConfig.from_env({"ARC_OPERATOR_ROUTER_IMAGE": IMAGE}).router_image == IMAGE


def run_router(*args: str) -> str:
    """Start the real vllm-router with ``args`` (a static worker nobody serves); its output."""
    command = [
        sys.executable, "-m", "vllm_router.launch_router",
        "--host", "127.0.0.1", "--port", "47140", "--prometheus-port", "47141",
        "--policy", "kv_aware", "--worker-urls", "http://127.0.0.1:47142",
        "--kv-event-source", "http://127.0.0.1:47142=tcp://127.0.0.1:47143",
        "--kv-event-model", "qwen",
        "--worker-startup-timeout-secs", "1", "--worker-startup-check-interval", "1",
        *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0, "the router cannot start without a healthy worker"
    return done.stderr + done.stdout


@pytest.mark.parametrize(
    ("block_size", "outcome"),
    [
        # Accepted: the router goes on to wait for its worker.
        (ROUTER_MAX_BLOCK_SIZE, "waiting for hosts"),
        (ROUTER_MAX_BLOCK_SIZE + 1, "OverflowError"),
        (0, "needs a nonzero block size"),
    ],
)
def test_the_router_takes_block_sizes_up_to_the_spec_limit(block_size: int, outcome: str) -> None:
    assert outcome in run_router("--kv-event-block-size", str(block_size))


# --- the router's children ------------------------------------------------------------------


def test_no_router_children_without_routing() -> None:
    spec = parse(make_spec(replicas=3, routing={"policy": "none"}))
    assert manifests.router_children("d", "ns", spec, ENDPOINTS, image=IMAGE, peers=[]) == []


@pytest.mark.parametrize("policy", ROUTERS)
@pytest.mark.parametrize("key", [True, False])
@pytest.mark.parametrize("peers", [PEERS, []])
def test_router_children_validate_against_kubernetes_schemas(
    policy: RoutingPolicy, key: bool, peers: list
) -> None:
    spec = routed(policy)
    if not key:
        del spec["apiKeySecretRef"]
        spec["allowUnauthenticated"] = True
    for endpoints in (ENDPOINTS, ()):
        for child in manifests.router_children(
            "demo", "serving", parse(spec), endpoints, image=IMAGE, peers=peers
        ):
            kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_router_children_names_labels_and_apply_order() -> None:
    kinds = [c["kind"] for c in router_children(routed("round_robin")).values()]
    assert kinds == [kind for _, kind in manifests.ROUTER_KINDS]
    assert list(router_children(routed("kv_aware"))) == [
        "ServiceAccount", "Deployment", "Service", "NetworkPolicy",
    ]  # fmt: skip
    for child in router_children(routed("round_robin")).values():
        assert child["metadata"]["name"] == "demo-router"
        assert child["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
        assert child["metadata"]["labels"]["arcserving.io/servingpolicy"] == "demo"
    no_policy = manifests.router_children(
        "demo", "serving", parse(routed("kv_aware")), ENDPOINTS, image=IMAGE, peers=None
    )
    assert "NetworkPolicy" not in [c["kind"] for c in no_policy]


def test_router_pods_are_never_selected_as_serving_pods() -> None:
    spec = parse(routed("kv_aware"))
    serving = manifests.deployment("demo", "serving", spec)
    router = router_children(routed("kv_aware"))["Deployment"]
    router_pod = router["spec"]["template"]["metadata"]["labels"]
    serving_pod = serving["spec"]["template"]["metadata"]["labels"]
    assert not serving["spec"]["selector"]["matchLabels"].items() <= router_pod.items()
    assert not router["spec"]["selector"]["matchLabels"].items() <= serving_pod.items()
    assert serving_pod["app.kubernetes.io/component"] == "serving"
    # Service discovery selects what the serving pods carry, and only them.
    args = parse_router_args(router_container(routed("round_robin"))["args"])
    assert args.selector.items() <= serving_pod.items()
    assert not args.selector.items() <= router_pod.items()


def test_kv_aware_router_args_parse_as_static_workers_with_their_event_sockets() -> None:
    container = router_container(routed("kv_aware", cache={"blockSize": 32, "numBlocks": 512}))
    assert container["command"] == ["vllm-router"]
    args = parse_router_args(container["args"])
    assert (args.host, args.port, args.policy) == ("0.0.0.0", 8000, "kv_aware")
    assert (args.prometheus_host, args.prometheus_port) == ("0.0.0.0", 29000)
    assert args.worker_urls == ["http://10.0.0.7:8000", "http://[fd00::8]:8000"]
    assert args.kv_event_source == [
        "http://10.0.0.7:8000=tcp://10.0.0.7:5557",
        "http://[fd00::8]:8000=tcp://[fd00::8]:5557",
    ]
    assert args.kv_event_replay_source == [
        "http://10.0.0.7:8000=tcp://10.0.0.7:5558",
        "http://[fd00::8]:8000=tcp://[fd00::8]:5558",
    ]
    # The router hashes prompts as the pods do: their block size, their served model name.
    assert (args.kv_event_block_size, args.kv_event_model) == (32, "qwen")
    # Equal costs are drawn at random rather than all sent to the first registered worker.
    assert args.router_temperature == 1.0
    assert not args.service_discovery
    # Kubernetes expands $(VLLM_API_KEY) from the env, which comes from the Secret; the router
    # must read any key as the value, also one that starts with "-".
    assert args.api_key == "$(VLLM_API_KEY)"
    expanded = [arg.replace("$(VLLM_API_KEY)", "-Kx_9") for arg in container["args"]]
    assert parse_router_args(expanded).api_key == "-Kx_9"
    (key,) = [var for var in container["env"] if var["name"] == "VLLM_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {
        "name": "qwen-api-key",
        "key": "api-key",
        "optional": False,
    }


@pytest.mark.parametrize("policy", DISCOVERY)
def test_other_policies_discover_this_servingpolicys_serving_pods(policy: RoutingPolicy) -> None:
    spec = routed(policy, routing={"args": ["--queue-size", "7"]})
    args = parse_router_args(router_container(spec)["args"])
    assert args.policy == policy.value and args.service_discovery
    assert args.selector == {
        "arcserving.io/servingpolicy": "demo",
        "app.kubernetes.io/component": "serving",
    }
    assert (args.service_discovery_namespace, args.service_discovery_port) == ("serving", 8000)
    assert args.worker_urls == [] and args.kv_event_source == []
    assert args.queue_size == 7  # routing.args come last


def test_without_an_api_key_the_router_gets_none() -> None:
    spec = routed("kv_aware", allowUnauthenticated=True)
    del spec["apiKeySecretRef"]
    container = router_container(spec)
    assert parse_router_args(container["args"]).api_key is None
    assert "VLLM_API_KEY" not in [var["name"] for var in container["env"]]


def test_kv_aware_router_is_a_function_of_the_spec_and_the_ready_endpoints() -> None:
    spec = routed("kv_aware")
    assert router_children(spec) == router_children(spec)
    one = router_children(spec, ENDPOINTS[:1])["Deployment"]
    assert one != router_children(spec)["Deployment"]
    assert one["spec"]["replicas"] == 1
    # No ready serving pod: no worker to start with, so no router pod.
    none = router_children(spec, ())["Deployment"]
    assert none["spec"]["replicas"] == 0
    assert "--worker-urls" not in none["spec"]["template"]["spec"]["containers"][0]["args"]
    # Discovery routers do not depend on the endpoints.
    discovery = routed("power_of_two", routing={"replicas": 3})
    assert router_children(discovery, ())["Deployment"] == router_children(discovery)["Deployment"]
    assert router_children(discovery, ())["Deployment"]["spec"]["replicas"] == 3


def test_router_pod_runs_non_root_read_only_with_probes_and_bounded_resources() -> None:
    spec = routed("kv_aware", routing={"resources": {"cpu": "2", "memory": "2Gi"}})
    deployment = router_children(spec)["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    limits = {"cpu": "2", "memory": "2Gi"}
    assert container["resources"] == {"requests": limits, "limits": limits}
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {
        ("http", 8000),
        ("metrics", 29000),
    }
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    service = router_children(spec)["Service"]
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
        ("http", 8000),
        ("metrics", 29000),
    ]


def test_only_discovery_routers_hold_a_token_and_may_read_pods() -> None:
    kv = router_children(routed("kv_aware"))
    assert kv["ServiceAccount"]["automountServiceAccountToken"] is False
    assert kv["Deployment"]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "Role" not in kv and "RoleBinding" not in kv
    rr = router_children(routed("round_robin"))
    assert rr["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "demo-router"
    assert rr["Deployment"]["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert rr["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert rr["RoleBinding"]["roleRef"]["name"] == "demo-router"
    assert rr["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-router", "namespace": "serving"}
    ]


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = manifests.deployment("demo", "serving", parse(spec))["spec"]["template"]["spec"][
        "containers"
    ]
    return container


def test_kv_aware_serving_pods_publish_kv_events_and_render_prompts() -> None:
    container = engine(routed("kv_aware"))
    args = container["args"]
    config = args[args.index("--kv-events-config") + 1]
    assert config == (
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:5558","topic":""}'
    )
    assert "--enable-scale-out" in args and "--enable-prefix-caching" in args
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [
        ("http", 8000),
        ("kv-events", 5557),
        ("kv-replay", 5558),
    ]
    for policy in ("none", *DISCOVERY):
        other = engine(routed(policy))
        assert "--kv-events-config" not in other["args"]
        assert [p["name"] for p in other["ports"]] == ["http"]


def ingress(policy: dict[str, Any]) -> list[tuple[list[int], list[dict[str, Any]]]]:
    return [
        ([port["port"] for port in rule["ports"]], rule["from"])
        for rule in policy["spec"]["ingress"]
    ]


ROUTER_PODS = {"podSelector": {"matchLabels": manifests.router_selector_labels("demo")}}


@pytest.mark.parametrize("policy", ROUTERS)
def test_with_a_router_only_it_reaches_the_serving_api(policy: RoutingPolicy) -> None:
    spec = parse(routed(policy))
    (serving,) = [
        c
        for c in manifests.children("demo", "serving", spec, PEERS, MONITORING)
        if c["kind"] == "NetworkPolicy"
    ]
    expected = [([8000], [ROUTER_PODS, *MONITORING])]
    if policy is RoutingPolicy.KV_AWARE:
        expected.append(([5557, 5558], [ROUTER_PODS]))
    assert ingress(serving) == expected
    assert ROUTER_PODS["podSelector"]["matchLabels"].items() <= (
        router_children(routed(policy))["Deployment"]["spec"]["template"]["metadata"][
            "labels"
        ].items()
    )
    # The router: the API from the configured clients, its /metrics from the scrapers.
    router = router_children(routed(policy))["NetworkPolicy"]
    assert router["spec"]["podSelector"]["matchLabels"] == manifests.router_selector_labels("demo")
    assert ingress(router) == [([8000], PEERS), ([29000], MONITORING)]
    kubernetes_validate.validate(serving, K8S_VERSION, strict=True)


def test_without_routing_clients_and_scrapers_reach_the_serving_api() -> None:
    spec = parse(make_spec())
    (serving,) = [
        c
        for c in manifests.children("demo", "serving", spec, PEERS, [*MONITORING, *PEERS])
        if c["kind"] == "NetworkPolicy"
    ]
    assert ingress(serving) == [([8000], [*PEERS, *MONITORING])]


@pytest.mark.parametrize(
    "given", [["--router-temperature", "0"], ["--router-temperature=25.5"], ["--router-temp", "3"]]
)
def test_a_router_temperature_in_routing_args_replaces_the_default(given: list[str]) -> None:
    args = router_container(routed("kv_aware", routing={"args": given}))["args"]
    assert args[-len(given) :] == given
    assert parse_router_args(args).router_temperature == float(given[-1].split("=")[-1])
    assert not [arg for arg in args[: -len(given)] if arg.startswith("--router-temp")]


def test_a_session_affinity_ttl_in_routing_args_reaches_the_router() -> None:
    given = ["--kv-aware-session-affinity-ttl-secs", "300"]
    args = router_container(routed("kv_aware", routing={"args": given}))["args"]
    assert parse_router_args(args).kv_aware_session_affinity_ttl_secs == 300


def test_only_kv_aware_gets_a_default_router_temperature() -> None:
    for policy in DISCOVERY:
        args = router_container(routed(policy))["args"]
        assert "--router-temperature" not in args, policy
