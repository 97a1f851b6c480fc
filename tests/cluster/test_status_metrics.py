"""The operator's metrics readings end to end on the real API server.

kwok runs no container, so no pod answers on its address. The test run's network namespace
(cluster/netns.py) makes the simulated pods' range local, so here the test serves a vLLM-like
/metrics on each pod's address at the operator's metrics port, on a kwok node of its own: the
operator's real scrapes fill `activePolicy`, `hitRate`, `replicaHitRates`, `PolicyApplied` and
`Ready`, and `kubectl get sp` shows them.
"""

from __future__ import annotations

import json
import random
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from arc_operator.metrics import POLICY_INFO
from cluster.local import node_manifest
from tests.cluster.helpers import (
    HostOperator,
    Kube,
    MakePolicy,
    Release,
    condition,
    patch,
    ready_pods,
    wait_for,
)

pytestmark = pytest.mark.slow

HITS_PER_SCRAPE, QUERIES_PER_SCRAPE = 30.0, 60.0  # a steady hit rate of 0.5


@dataclass
class PodMetrics:
    """What one pod's /metrics shows: the active policy and counters that grow by a fixed step
    at every scrape, as a pod under steady load shows."""

    policy: str
    hits: float = 0.0
    queries: float = 0.0
    scrapes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def scrape(self) -> bytes:
        with self.lock:
            self.scrapes += 1
            self.hits += HITS_PER_SCRAPE
            self.queries += QUERIES_PER_SCRAPE
            registry = CollectorRegistry()
            labels = {"model_name": "qwen", "engine": "0"}
            Counter("vllm:prefix_cache_hits", "hits", list(labels), registry=registry).labels(
                **labels
            ).inc(self.hits)
            Counter("vllm:prefix_cache_queries", "q", list(labels), registry=registry).labels(
                **labels
            ).inc(self.queries)
            Gauge(POLICY_INFO, "active policy", ["policy"], registry=registry).labels(
                policy=self.policy
            ).set(1)
            return generate_latest(registry)


def serve(ip: str, port: int, metrics: PodMetrics) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics.scrape() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((ip, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def metrics_node(kube: Kube) -> Iterator[str]:
    """A kwok node of its own, the only schedulable one while it exists (its pod CIDR past
    those of the cluster's nodes)."""
    name = f"kwok-metrics-{secrets.token_hex(2)}"
    manifest = node_manifest(name, random.randint(64, 126))
    kube.run("apply", "-f", "-", input=json.dumps(manifest))
    others = [
        n["metadata"]["name"]
        for n in (kube.get("nodes") or {})["items"]
        if n["metadata"]["name"] != name and not n["spec"].get("unschedulable")
    ]
    for node in others:
        kube.run("cordon", node)
    try:
        wait_for(
            f"node {name} Ready",
            lambda: condition(kube.get("node", name) or {}, "Ready").get("status") == "True",
        )
        yield name
    finally:
        for node in others:
            kube.run("uncordon", node, check=False)
        kube.run("delete", "node", name, "--wait=false", check=False)


def test_scraped_metrics_fill_status_and_printer_columns(
    kube: Kube,
    release: Release,
    host_operator: HostOperator,
    metrics_node: str,
    make_policy: MakePolicy,
) -> None:
    ns, name = release.namespace, "metrics"
    make_policy(name, replicas=2, policy="ARC", switchMode="Hot")

    def two_ready() -> list[dict[str, Any]] | None:
        pods = ready_pods(kube, ns, name)
        return pods if len(pods) == 2 else None

    pods = wait_for("two ready pods", two_ready)
    assert {p["spec"]["nodeName"] for p in pods} == {metrics_node}
    metrics = {p["metadata"]["name"]: PodMetrics("arc") for p in pods}
    servers = [
        serve(p["status"]["podIP"], host_operator.metrics_port, metrics[p["metadata"]["name"]])
        for p in pods
    ]
    try:

        def policy_active(policy: str) -> dict[str, Any] | None:
            sp = kube.get("servingpolicy", name, "-n", ns) or {}
            status = sp.get("status", {})
            applied = condition(sp, "PolicyApplied")
            if (
                applied.get("reason") == "PolicyActive"
                and status.get("activePolicy") == policy.upper()
                and status.get("hitRate") is not None
                and len(status.get("replicaHitRates", [])) == 2
                and condition(sp, "Ready").get("status") == "True"
            ):
                return sp
            return None

        def sp_status() -> object:
            return (kube.get("servingpolicy", name, "-n", ns) or {}).get("status")

        sp = wait_for(
            "PolicyActive with arc and a hit rate", lambda: policy_active("arc"), detail=sp_status
        )
        status = sp["status"]
        assert status["hitRate"] == pytest.approx(0.5)
        assert [r["pod"] for r in status["replicaHitRates"]] == sorted(metrics)
        assert all(r["hitRate"] == pytest.approx(0.5) for r in status["replicaHitRates"])
        assert status["phase"] == "Ready"
        assert all(m.scrapes > 0 for m in metrics.values())
        header, row = kube.run("get", "sp", name, "-n", ns, "-o", "wide").stdout.splitlines()[:2]
        assert header.split() == [
            "NAME",
            "POLICY",
            "ROUTING",
            "READY",
            "HIT",
            "RATE",
            "AGE",
            "ACTIVE",
            "PHASE",
        ]
        cells = row.split()
        assert cells[:5] == [name, "ARC", "kv_aware", "True", "0.5"]
        assert cells[-2:] == ["ARC", "Ready"]

        # A hot switch: the ConfigMap changes at once; until the pods report the new policy
        # the status says Switching, then PolicyActive again.
        patch(kube, ns, name, {"policy": "LRU"})

        def switching() -> dict[str, Any] | None:
            sp = kube.get("servingpolicy", name, "-n", ns) or {}
            return sp if condition(sp, "PolicyApplied").get("status") == "False" else None

        sp = wait_for(
            "PolicyApplied=False while the pods still run arc", switching, detail=sp_status
        )
        print("while switching:", condition(sp, "PolicyApplied"))
        for pod_metrics in metrics.values():
            pod_metrics.policy = "lru"
        wait_for("PolicyActive with lru", lambda: policy_active("lru"), detail=sp_status)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
