"""Pods that leave lose nothing: the preStop wait, the drain bound and the grace period derived
from the spec, the PodDisruptionBudgets, the rolling strategy and the router's retry flags
(docs/operator.md, "Disruptions"). Pure manifests, plus the preStop's wait run for real
against a /metrics served on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import kubernetes_validate
import pytest
from vllm_router.launch_router import parse_router_args

from arc_operator import manifests
from arc_operator.models import SpecError, parse_spec
from tests.operator.conftest import make_spec

K8S_VERSION = "1.33"
IMAGE = "ghcr.io/arc-serving/router:0.1.0"
ENDPOINTS = (manifests.Endpoint("demo-a", "10.0.0.7"),)


def serving_pod(spec: dict[str, Any]) -> dict[str, Any]:
    return manifests.deployment("demo", "serving", parse_spec(spec))["spec"]["template"]["spec"]


def router_pod(spec: dict[str, Any]) -> dict[str, Any]:
    deployment = manifests.router_deployment("demo", "serving", parse_spec(spec), ENDPOINTS, IMAGE)
    return deployment["spec"]["template"]["spec"]


def option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_serving_pod_waits_in_pre_stop_then_drains_within_its_grace_period() -> None:
    pod = serving_pod(make_spec(maxModelLen=4096))
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [
        "python3", "-c", manifests.DRAIN_WAIT, "5", str(manifests.DRAIN_QUIET_S),
        "http://127.0.0.1:8000/metrics",
    ]  # fmt: skip
    # 4096 tokens at 50 tokens/s, rounded up: vLLM drains for at most 82 s.
    assert option(container["args"], "--shutdown-timeout") == "82"
    assert pod["terminationGracePeriodSeconds"] == 5 + 82 + manifests.EXIT_MARGIN_S


@pytest.mark.parametrize(
    ("disruption", "max_model_len", "drain", "grace"),
    [
        ({}, 2048, 41, 5 + 41),
        ({}, 2049, 41, 5 + 41),
        ({"requestSeconds": 30}, 8192, 30, 5 + 30),
        ({"requestSeconds": 30, "drainDelaySeconds": 0}, 8192, 30, 30),
        ({"drainDelaySeconds": 12}, 100, 2, 12 + 2),
    ],
)
def test_drain_bound_and_grace_period_follow_max_model_len_unless_overridden(
    disruption: dict[str, int], max_model_len: int, drain: int, grace: int
) -> None:
    spec = make_spec(maxModelLen=max_model_len, disruption=disruption)
    pod = serving_pod(spec)
    (container,) = pod["containers"]
    assert option(container["args"], "--shutdown-timeout") == str(drain)
    assert pod["terminationGracePeriodSeconds"] == grace + manifests.EXIT_MARGIN_S
    bound = container["lifecycle"]["preStop"]["exec"]["command"][3]
    assert bound == str(disruption.get("drainDelaySeconds", 5))
    # The router holds the same requests' streams: the same bound, a plain sleep.
    router = router_pod({**spec, "routing": {"policy": "round_robin"}})
    (router_container,) = router["containers"]
    assert router_container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", bound]
    assert router["terminationGracePeriodSeconds"] == pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("replicas", [0, 1])
def test_no_budget_with_at_most_one_replica(replicas: int) -> None:
    spec = parse_spec(make_spec(replicas=replicas, disruption={"maxUnavailable": 3}))
    kinds = [child["kind"] for child in manifests.children("demo", "serving", spec, [])]
    assert "PodDisruptionBudget" not in kinds


@pytest.mark.parametrize(("replicas", "max_unavailable"), [(2, 1), (5, 2), (3, 3)])
def test_budget_selects_the_serving_pods_with_the_spec_max_unavailable(
    replicas: int, max_unavailable: int
) -> None:
    spec = parse_spec(make_spec(replicas=replicas, disruption={"maxUnavailable": max_unavailable}))
    children = manifests.children("demo", "serving", spec, [])
    budget = children[-1]
    assert budget["kind"] == "PodDisruptionBudget" and budget["metadata"]["name"] == "demo"
    assert budget["spec"]["maxUnavailable"] == max_unavailable
    deployment = children[0]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    kubernetes_validate.validate(budget, K8S_VERSION, strict=True)
    # A rollout starts a new pod before it stops one: it never takes a pod the budget counts.
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxUnavailable": 0, "maxSurge": 1}
    assert rolling["maxUnavailable"] <= budget["spec"]["maxUnavailable"]


@pytest.mark.parametrize(("routers", "budgets"), [(1, []), (2, ["demo-router"])])
def test_router_budget_only_with_more_than_one_router(routers: int, budgets: list[str]) -> None:
    spec = parse_spec(make_spec(replicas=2, routing={"policy": "kv_aware", "replicas": routers}))
    children = manifests.router_children(
        "demo", "serving", spec, ENDPOINTS, image=IMAGE, peers=[], monitoring=[]
    )
    found = [child for child in children if child["kind"] == "PodDisruptionBudget"]
    assert [child["metadata"]["name"] for child in found] == budgets
    for budget in found:
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"] == manifests.router_selector_labels("demo")
        kubernetes_validate.validate(budget, K8S_VERSION, strict=True)


def test_router_retries_and_circuit_breaker_move_a_refused_request_elsewhere() -> None:
    (container,) = router_pod(make_spec(replicas=2))["containers"]
    args = parse_router_args(container["args"])
    assert args.retry_max_retries == 5
    assert (args.cb_failure_threshold, args.cb_success_threshold) == (2, 1)
    assert args.cb_timeout_duration_secs == 5
    assert not args.disable_retries and not args.disable_circuit_breaker


def test_routing_args_override_a_resilience_default_without_repeating_it() -> None:
    routing = {"policy": "kv_aware", "args": ["--cb-failure-threshold=4", "--disable-retries"]}
    (container,) = router_pod(make_spec(replicas=2, routing=routing))["containers"]
    flags = [arg.split("=", 1)[0] for arg in container["args"]]
    assert flags.count("--cb-failure-threshold") == 1
    args = parse_router_args(container["args"])
    assert (args.cb_failure_threshold, args.disable_retries) == (4, True)
    assert args.cb_timeout_duration_secs == 5


@pytest.mark.parametrize(
    ("disruption", "field"),
    [
        ({"maxUnavailable": 0}, "spec.disruption.maxUnavailable"),
        ({"drainDelaySeconds": -1}, "spec.disruption.drainDelaySeconds"),
        ({"requestSeconds": 0}, "spec.disruption.requestSeconds"),
        ({"requestSeconds": 86401}, "spec.disruption.requestSeconds"),
        ({"maxUnavailable": "25%"}, "spec.disruption.maxUnavailable"),
        ({"grace": 10}, "spec.disruption.grace"),
    ],
)
def test_a_bad_disruption_field_is_refused_by_name(disruption: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        parse_spec(make_spec(disruption=disruption))


@pytest.mark.parametrize("arg", ["--shutdown-timeout", "--shutdown_timeout=5", "--shutdown-t"])
def test_engine_args_may_not_set_the_drain_bound(arg: str) -> None:
    with pytest.raises(SpecError, match="--shutdown-timeout"):
        parse_spec(make_spec(engineArgs=[arg, "5"]))


# --- the preStop wait, run ------------------------------------------------------------------


class Metrics(BaseHTTPRequestHandler):
    """vLLM's /metrics lines the wait counts, with a request counter that grows at every read
    while ``busy`` is set."""

    busy = False
    reads = 0

    def do_GET(self) -> None:
        type(self).reads += 1
        finished = type(self).reads if type(self).busy else 0
        body = (
            "# HELP vllm:request_success_total Finished requests.\n"
            f'vllm:request_success_total{{finished_reason="stop"}} {finished}.0\n'
            'vllm:request_success_created{finished_reason="stop"} 1.7e9\n'
            "vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def metrics() -> Iterator[tuple[type[Metrics], str]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Metrics.busy, Metrics.reads = False, 0
    yield Metrics, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def wait_seconds(bound: float, quiet: float, url: str) -> float:
    """How long the preStop wait ran."""
    start = time.monotonic()
    command = [sys.executable, "-c", manifests.DRAIN_WAIT, str(bound), str(quiet), url]
    subprocess.run(command, check=True, timeout=60)
    return time.monotonic() - start


def test_pre_stop_ends_once_no_request_arrived_for_the_quiet_time(metrics) -> None:
    _, url = metrics
    assert 1.0 <= wait_seconds(bound=30, quiet=1, url=url) < 20


def test_pre_stop_waits_out_its_bound_while_requests_keep_arriving(metrics) -> None:
    handler, url = metrics
    handler.busy = True
    assert wait_seconds(bound=3, quiet=1, url=url) >= 3
    assert handler.reads >= 3


def test_pre_stop_of_a_server_that_does_not_answer_ends_after_the_quiet_time() -> None:
    # Nothing listens on port 9 of 127.0.0.1 in the test's network namespace.
    assert wait_seconds(bound=30, quiet=1, url="http://127.0.0.1:9/metrics") < 20
