"""The cluster's ingress controller (cluster/ingress.py): the real Traefik (`.tools/bin/traefik`,
and the same binary in its image run by runc) against a real API server of its own
(out/cluster-traefik), in this test's loopback-only network namespace.

Traefik runs with the Deployment's own flags, but on free ports of 127.0.0.1 and with a
kubeconfig of the manifests' ServiceAccount (a TokenRequest token), so the ClusterRole's grants
are what it works with. The backend is a Python HTTP server behind a Service without a
selector, whose EndpointSlice this test writes as the EndpointSlice controller would for a pod;
an Ingress and an HTTPRoute lead to it. It serves on an address of kwok's simulated pod range,
local to the namespace (cluster/netns.py), in a /24 no node has: the API server refuses a
loopback address in an EndpointSlice.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from arc_harness.listening import sample_listeners
from arc_harness.vllm_server import free_port
from cluster.addons import apply_gateway_api_crds
from cluster.ingress import (
    CLASS_NAME,
    GATEWAY_CONTROLLER,
    IMAGE,
    IMAGE_USER,
    INGRESS_CONTROLLER,
    NAME,
    NAMESPACE,
    SERVICE_PORT,
    TRAEFIK_BINARY,
    TRAEFIK_VERSION,
    WEB_PORT,
    manifests,
    traefik_args,
)
from cluster.local import LocalCluster, pod_cidr
from tests.cluster.helpers import (
    REPO,
    START_TIMEOUT_S,
    Kube,
    audit_events,
    audit_offset,
    wait_for,
)
from tests.images.containers import Bind, Container, skip_unless_runnable

pytestmark = pytest.mark.slow

OUT = REPO / "out" / "cluster-traefik"
SERVICE_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{NAME}"
# Not 127.0.0.1, where Traefik listens: the routes must lead to the EndpointSlice's address.
BACKEND_ADDRESS = str(ipaddress.ip_network(pod_cidr(100))[23])
READY_TIMEOUT_S = 60.0
# One route change seen by Traefik's watches and applied, on a loaded 2-core machine.
ROUTE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Setup:
    """The control plane with Traefik's manifests applied; the Gateway listens on web_port."""

    kube: Kube
    web_port: int


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    """A control plane of its own (in place of conftest.py's shared one), the Gateway API's
    CRDs established, the manifests applied with Traefik's pod on a kwok node and the Gateway's
    listener on a free port, which the Traefik of each test listens on."""
    if not TRAEFIK_BINARY.is_file():
        pytest.fail(f"no {TRAEFIK_BINARY}: run `make cluster-binaries`")
    cluster = LocalCluster(out=OUT, name="arc-traefik")
    started = cluster.up(timeout=START_TIMEOUT_S)
    try:
        kube = Kube(cluster, cluster.kubeconfig)
        apply_gateway_api_crds(cluster)
        web_port = free_port()
        objects = manifests(node_selector={"type": "kwok"}, web_port=web_port)
        applied = kube.run("apply", "-f", "-", input=json.dumps(as_list(objects)))
        # The namespace warns at the restricted Pod Security Standard: the pod meets it.
        assert "Warning" not in applied.stderr, applied.stderr
        yield Setup(kube, web_port)
    finally:
        if started:
            cluster.down()


def as_list(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "List", "items": objects}


@dataclass
class Backend:
    """A Python HTTP server on BACKEND_ADDRESS that answers every GET with its own token and
    records the paths and headers it was asked for."""

    port: int
    token: str
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    token = secrets.token_hex(8)
    seen: list[tuple[str, dict[str, str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, dict(self.headers)))
            body = json.dumps({"token": token, "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((BACKEND_ADDRESS, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Backend(server.server_address[1], token, seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def routes(setup: Setup, backend: Backend) -> Iterator[str]:
    """A namespace with the Service `echo` (no selector), its EndpointSlice naming the backend,
    an Ingress of class traefik for /via-ingress and an HTTPRoute on the Gateway for
    /via-gateway, both to `echo`'s port 80; the namespace's name."""
    kube = setup.kube
    namespace = f"app-{secrets.token_hex(3)}"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "echo", "namespace": namespace},
        "spec": {
            "ports": [
                {
                    "name": "http",
                    "port": SERVICE_PORT,
                    "targetPort": backend.port,
                    "protocol": "TCP",
                }
            ]
        },
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "echo-local",
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": "echo",
                "endpointslice.kubernetes.io/managed-by": "arc-serving-tests",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [BACKEND_ADDRESS], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": backend.port, "protocol": "TCP"}],
    }
    backend_ref = {"name": "echo", "port": {"number": SERVICE_PORT}}
    ingress = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "Ingress",
        "metadata": {"name": "echo", "namespace": namespace},
        "spec": {
            "ingressClassName": CLASS_NAME,
            "rules": [
                {
                    "http": {
                        "paths": [
                            {
                                "path": "/via-ingress",
                                "pathType": "Prefix",
                                "backend": {"service": backend_ref},
                            }
                        ]
                    }
                }
            ],
        },
    }
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "echo", "namespace": namespace},
        "spec": {
            "parentRefs": [{"name": NAME, "namespace": NAMESPACE, "sectionName": "web"}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/via-gateway"}}],
                    "backendRefs": [{"name": "echo", "port": SERVICE_PORT}],
                }
            ],
        },
    }
    kube.run("create", "namespace", namespace)
    try:
        objects = [service, endpoints, ingress, route]
        kube.run("apply", "-f", "-", input=json.dumps(as_list(objects)))
        yield namespace
    finally:
        kube.run("delete", "namespace", namespace, "--wait=false", check=False)


@dataclass
class Traefik:
    """A running Traefik: its entry points on 127.0.0.1, how long it took to answer /ping and
    to route both paths, what the API server's audit log held when it started."""

    mode: str
    web_port: int
    ping_port: int
    audit_from: int
    log: Callable[[], str]
    pid: int | None
    ready_s: float = 0.0
    routed_s: float = 0.0


def get(url: str) -> tuple[int, str]:
    """The status and body of a GET; (0, reason) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError) as error:
        return 0, str(error)


def _wait_running(traefik: Traefik, alive: Callable[[], bool], started: float) -> None:
    """Fill in ready_s (/ping answers) and routed_s (both paths reach the backend)."""
    base = f"http://127.0.0.1:{traefik.web_port}"
    ping = f"http://127.0.0.1:{traefik.ping_port}/ping"
    waiting = {"ready": ping, "ingress": f"{base}/via-ingress", "gateway": f"{base}/via-gateway"}
    deadline = started + READY_TIMEOUT_S
    while waiting:
        if not alive():
            pytest.fail(f"Traefik ({traefik.mode}) exited:\n{traefik.log()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(
                f"Traefik ({traefik.mode}) did not answer {sorted(waiting)} within "
                f"{READY_TIMEOUT_S:.0f} s:\n{traefik.log()[-4000:]}"
            )
        for what, url in list(waiting.items()):
            if get(url)[0] == 200:
                del waiting[what]
                if what == "ready":
                    traefik.ready_s = time.monotonic() - started
        time.sleep(0.05)
    traefik.routed_s = time.monotonic() - started


def _kubeconfig(kube: Kube, folder: Path, uid: int) -> Path:
    """A kubeconfig of the manifests' ServiceAccount in ``folder``, readable by ``uid``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = kube.cluster.write_token_kubeconfig(NAME, NAMESPACE, folder / "kubeconfig")
    os.chown(written, uid, uid)
    return written


@pytest.fixture(scope="module", params=["process", "image"])
def traefik(request: pytest.FixtureRequest, setup: Setup, routes: str) -> Iterator[Traefik]:
    """Traefik as a process of this test, or its image as a container (runc, every capability
    dropped, read-only root) sharing this test's network namespace, started after the routes
    exist: routed_s is the time from its start to serving them."""
    folder = OUT / f"traefik-{request.param}"
    ping_port = free_port()
    args = traefik_args(bind="127.0.0.1", web_port=setup.web_port, ping_port=ping_port)
    if request.param == "process":
        kubeconfig = _kubeconfig(setup.kube, folder, os.getuid())
        log_path = folder / "traefik.log"
        audit_from = audit_offset(setup.kube)
        with log_path.open("wb") as log:
            started = time.monotonic()
            process = subprocess.Popen(
                [str(TRAEFIK_BINARY), *args],
                env={"PATH": os.environ["PATH"], "KUBECONFIG": str(kubeconfig)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        running = Traefik(
            "process",
            setup.web_port,
            ping_port,
            audit_from,
            lambda: log_path.read_text(errors="replace"),
            process.pid,
        )
        try:
            _wait_running(running, lambda: process.poll() is None, started)
            yield running
        finally:
            process.terminate()
            process.wait(timeout=30)
        return
    skip_unless_runnable(IMAGE, "make cluster-images")
    _kubeconfig(setup.kube, folder, IMAGE_USER)
    container = Container(
        IMAGE,
        args=args,
        env={"KUBECONFIG": "/etc/traefik/kubeconfig"},
        binds=[Bind(folder, "/etc/traefik")],
        log_path=folder / "container.log",
    )
    with container:
        assert container.config is not None
        assert container.config.user == f"{IMAGE_USER}:{IMAGE_USER}"
        assert container.config.entrypoint == ["/traefik"]
        audit_from = audit_offset(setup.kube)
        started = time.monotonic()
        container.start()
        running = Traefik("image", setup.web_port, ping_port, audit_from, container.log, None)
        _wait_running(running, container.running, started)
        yield running


def test_manifests_run_traefik_on_the_real_node_with_both_classes() -> None:
    go_mod = (REPO / "cluster" / "tools" / "traefik" / "go.mod").read_text()
    assert f"github.com/traefik/traefik/v3 {TRAEFIK_VERSION}" in go_mod
    by_kind = {o["kind"]: o for o in manifests()}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"type": "real"}
    container = pod["containers"][0]
    assert (container["image"], container["imagePullPolicy"]) == (IMAGE, "Never")
    assert container["args"] == traefik_args()
    assert "--providers.kubernetesIngress=true" in container["args"]
    assert "--providers.kubernetesGateway=true" in container["args"]
    assert by_kind["IngressClass"]["spec"]["controller"] == INGRESS_CONTROLLER
    assert by_kind["GatewayClass"]["spec"]["controllerName"] == GATEWAY_CONTROLLER
    listeners = by_kind["Gateway"]["spec"]["listeners"]
    assert [(item["port"], item["protocol"]) for item in listeners] == [(WEB_PORT, "HTTP")]
    assert by_kind["Service"]["spec"]["ports"][0]["targetPort"] == "web"
    subjects = by_kind["ClusterRoleBinding"]["subjects"]
    assert subjects == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    # A registry's image may be pulled; another namespace gets its own cluster-wide names.
    other = {o["kind"]: o for o in manifests("registry.example.com/traefik:1", namespace="edge")}
    other_pod = other["Deployment"]["spec"]["template"]["spec"]
    assert other_pod["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert other["ClusterRole"]["metadata"]["name"] == "traefik-edge"
    assert other["ClusterRoleBinding"]["subjects"][0]["namespace"] == "edge"


def test_the_deployment_is_admitted_under_the_restricted_standard(setup: Setup) -> None:
    """kwok runs the pod (the test's selector picks a kwok node): admitted, scheduled, Ready."""
    wait_for(
        "Traefik's Deployment to be available",
        lambda: (
            (setup.kube.get("deployment", NAME, "-n", NAMESPACE) or {})
            .get("status", {})
            .get("availableReplicas")
        ),
    )


def test_requests_reach_the_backend_through_the_ingress_and_the_httproute(
    traefik: Traefik, backend: Backend
) -> None:
    base = f"http://127.0.0.1:{traefik.web_port}"
    for path in ("/via-ingress/v1/models", "/via-gateway/v1/models?x=1"):
        before = len(backend.seen)
        status, body = get(base + path)
        assert status == 200, body
        assert json.loads(body) == {"token": backend.token, "path": path}
        (seen_path, headers), *_ = backend.seen[before:]
        assert seen_path == path
        # Traefik's reverse proxy, not a direct request, reached the backend.
        assert headers.get("X-Forwarded-Port") == str(traefik.web_port), headers
        assert "X-Forwarded-Server" in headers, headers
    # Neither an Ingress nor a route matches: Traefik answers, the backend is not asked.
    before = len(backend.seen)
    assert get(base + "/elsewhere")[0] == 404
    assert len(backend.seen) == before


def _condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    conditions = (obj or {}).get("status", {}).get("conditions", [])
    return next((c["status"] for c in conditions if c["type"] == kind), None)


def test_traefik_reports_the_gateway_api_status(
    setup: Setup, traefik: Traefik, routes: str
) -> None:
    kube = setup.kube
    assert _condition(kube.get("gatewayclass", CLASS_NAME), "Accepted") == "True"
    gateway = wait_for(
        "the Gateway Programmed",
        lambda: (
            g
            if _condition(g := kube.get("gateway", NAME, "-n", NAMESPACE), "Programmed") == "True"
            else None
        ),
        timeout=ROUTE_TIMEOUT_S,
    )
    assert _condition(gateway, "Accepted") == "True"
    listeners = {item["name"]: item for item in gateway["status"]["listeners"]}
    assert listeners["web"]["attachedRoutes"] == 1, listeners
    route = kube.get("httproute", "echo", "-n", routes)
    assert route is not None
    parents = route["status"]["parents"]
    assert [p["controllerName"] for p in parents] == [GATEWAY_CONTROLLER]
    states = {c["type"]: c["status"] for c in parents[0]["conditions"]}
    assert states["Accepted"] == "True" and states["ResolvedRefs"] == "True", parents


def test_every_request_of_the_service_account_is_allowed(setup: Setup, traefik: Traefik) -> None:
    """The ClusterRole grants what both providers ask for: nothing forbidden, from the start."""
    events = audit_events(setup.kube, traefik.audit_from, SERVICE_ACCOUNT)
    assert events, "no request of Traefik's ServiceAccount in the audit log"
    denied = [
        f"{e['verb']} {e.get('objectRef', {}).get('resource')}"
        for e in events
        if e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow"
    ]
    assert denied == []
    watched = {e.get("objectRef", {}).get("resource") for e in events if e["verb"] == "watch"}
    assert {"ingresses", "ingressclasses", "gateways", "httproutes", "endpointslices"} <= watched


def test_traefik_listens_on_loopback_only_and_reports_its_figures(traefik: Traefik) -> None:
    listeners = {item for item in sample_listeners() if "traefik" in item.command}
    assert {item.port for item in listeners} == {traefik.web_port, traefik.ping_port}
    assert all(item.is_loopback for item in listeners), [i.describe() for i in listeners]
    assert " ERR " not in traefik.log(), traefik.log()[-4000:]
    figures: dict[str, Any] = {
        "mode": traefik.mode,
        "version": TRAEFIK_VERSION,
        "ping_s": round(traefik.ready_s, 2),
        "routed_s": round(traefik.routed_s, 2),
    }
    if traefik.pid is not None:
        status = Path(f"/proc/{traefik.pid}/status").read_text().splitlines()
        memory = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status)
                  if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}  # fmt: skip
        figures |= {f"{key}_kib": value for key, value in memory.items()}
        # Within the Deployment's memory limit: the binary's pages it touched count too.
        deployment = next(o for o in manifests() if o["kind"] == "Deployment")
        limit = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limit["memory"].endswith("Mi")
        assert memory["VmHWM"] < int(limit["memory"].removesuffix("Mi")) * 1024
    (OUT / f"figures-{traefik.mode}.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"traefik figures: {figures}")
