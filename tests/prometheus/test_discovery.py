"""The scrape job of the end-to-end tests, on a real Prometheus: pods found through
``PodDiscovery`` (Kubernetes service discovery's pod labels, served over HTTP service discovery),
kept and labelled by the rules the Prometheus Operator writes for the chart's engine PodMonitor.

The pods are the operator's own engine pod (its Deployment's template) and two it must leave
out (another namespace, other labels), all with the address of a metrics endpoint this test
serves on 127.0.0.1."""

from __future__ import annotations

import copy
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from arc_harness.prometheus import (
    PodDiscovery,
    PrometheusServer,
    pod_monitor_discovery_job,
    pod_targets,
)
from arc_operator import manifests
from arc_operator.models import parse_spec
from tests.chart.chart_helpers import by_kind, one, render
from tests.operator.conftest import make_spec

pytestmark = pytest.mark.slow


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"# TYPE answered counter\nanswered_total 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return  # Prometheus's scrapes would fill the test's output


@pytest.fixture
def metrics_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def engine_pod(namespace: str, name: str, port: int) -> dict[str, Any]:
    """A running pod of the operator's engine Deployment for ServingPolicy ``demo``, its serving
    port moved to ``port`` on 127.0.0.1."""
    template = copy.deepcopy(
        manifests.deployment("demo", namespace, parse_spec(make_spec()))["spec"]["template"]
    )
    for container in template["spec"]["containers"]:
        for declared in container.get("ports", []):
            if declared.get("name") == "http":
                declared["containerPort"] = port
    return {
        "metadata": {**template["metadata"], "name": name, "namespace": namespace},
        "spec": {**template["spec"], "nodeName": "node-a"},
        "status": {"podIP": "127.0.0.1", "phase": "Running"},
    }


def test_discovered_engine_pod_is_scraped_with_the_operators_labels(metrics_port: int) -> None:
    monitors = by_kind(render(sets={"monitoring.podMonitor.enabled": "true"}), "PodMonitor")
    monitor = one(
        [m for m in monitors if m["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"],
        "PodMonitor",
    )
    namespace = monitor["metadata"]["namespace"]
    engine = engine_pod(namespace, "demo-0", metrics_port)
    elsewhere = engine_pod("other", "demo-1", metrics_port)
    unlabelled = engine_pod(namespace, "demo-2", metrics_port)
    unlabelled["metadata"]["labels"] = {"app": "something-else"}
    pods = [engine, elsewhere, unlabelled]
    assert len(pod_targets(pods)) >= 3
    with PodDiscovery(lambda: pods) as discovery:
        job = pod_monitor_discovery_job(monitor, discovery.url, 0.5)
        with PrometheusServer([job], evaluation_interval_s=0.5) as prometheus:
            prometheus.wait_until(
                lambda: bool(prometheus.query("up == 1")), 30, "the discovered pod's first scrape"
            )
            up = prometheus.query("up")
            assert len(up) == 1, up
            labels = up[0]["metric"]
            assert labels["namespace"] == namespace
            assert labels["pod"] == "demo-0"
            assert labels["container"] == "vllm"
            assert labels["endpoint"] == "http"
            assert labels["job"] == f"{namespace}/{monitor['metadata']['name']}"
            assert labels["servingpolicy"] == "demo"
            assert labels["instance"] == f"127.0.0.1:{metrics_port}"
