"""Cluster DNS (cluster/dns.py): the real CoreDNS (`.tools/bin/coredns`, and the same binary
in its image run by runc) against a real API server of its own (out/cluster-dns), in this
test's loopback-only network namespace.

CoreDNS runs with the Corefile the ConfigMap holds, but on free ports of 127.0.0.1 and with a
kubeconfig of the manifests' own ServiceAccount (a TokenRequest token), so the ClusterRole's
grants are what it works with. Service names resolve to their ClusterIPs, a headless Service's
to its EndpointSlices' ready addresses, and a name outside the cluster fails at once.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dns.exception
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.resolver
import dns.reversename
import pytest

from arc_harness.vllm_server import free_port
from cluster.dns import (
    CLUSTER_DOMAIN,
    CONTAINER_DNS_PORT,
    COREDNS_BINARY,
    COREDNS_VERSION,
    DNS_PORT,
    DNS_SERVICE_IP,
    IMAGE,
    IMAGE_USER,
    corefile,
    manifests,
)
from cluster.local import LocalCluster
from cluster.netns import SERVICE_RANGE
from tests.cluster.helpers import REPO, START_TIMEOUT_S, Kube, wait_for
from tests.images.containers import Bind, Container, skip_unless_runnable

pytestmark = pytest.mark.slow

OUT = REPO / "out" / "cluster-dns"
SERVICE_ACCOUNT = "system:serviceaccount:kube-system:coredns"
# What "at once" means for a name nothing answers: one round trip on loopback, no timeout.
AT_ONCE_S = 1.0
READY_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def kube() -> Iterator[Kube]:
    """A control plane of its own (in place of conftest.py's shared one), the DNS manifests
    applied in its kube-system, which enforces the restricted Pod Security Standard here."""
    cluster = LocalCluster(out=OUT, name="arc-dns")
    if not COREDNS_BINARY.is_file():
        pytest.fail(f"no {COREDNS_BINARY}: run `make {COREDNS_BINARY.relative_to(REPO)}`")
    started = cluster.up(timeout=START_TIMEOUT_S)
    try:
        kube = Kube(cluster, cluster.kubeconfig)
        kube.run(
            "label",
            "--overwrite",
            "namespace",
            "kube-system",
            "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/warn=restricted",
        )
        items = {"apiVersion": "v1", "kind": "List", "items": manifests()}
        applied = kube.run("apply", "-f", "-", input=json.dumps(items))
        assert "Warning" not in applied.stderr, applied.stderr
        yield kube
    finally:
        if started:
            cluster.down()


@dataclass(frozen=True)
class Server:
    """A running CoreDNS: its DNS port on 127.0.0.1, how long it took to be ready."""

    port: int
    ready_s: float
    pid: int | None


def _wait_ready(url: str, alive: Any, log: Any) -> float:
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT_S:
        if not alive():
            pytest.fail(f"CoreDNS exited before it was ready:\n{log()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.05)
    pytest.fail(f"CoreDNS not ready after {READY_TIMEOUT_S:.0f} s:\n{log()}")


def _config(kube: Kube, folder: Path, kubeconfig_path: Path, uid: int) -> tuple[int, int]:
    """The ConfigMap's Corefile on free local ports and a kubeconfig of the manifests'
    ServiceAccount (owned by `uid`, who runs CoreDNS), in `folder`; (DNS port, ready port)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = kube.cluster.write_token_kubeconfig("coredns", "kube-system", folder / "kubeconfig")
    os.chown(written, uid, uid)
    port, ready = free_port(), free_port()
    (folder / "Corefile").write_text(
        corefile(
            port=port,
            host="127.0.0.1",
            health_port=free_port(),
            ready_port=ready,
            metrics_port=free_port(),
            kubeconfig=(kubeconfig_path, "sa"),
        )
    )
    return port, ready


@pytest.fixture(scope="module", params=["process", "image"])
def server(request: pytest.FixtureRequest, kube: Kube) -> Iterator[Server]:
    """CoreDNS as a process of this test, or its image as a container (runc, every capability
    dropped, read-only root) sharing this test's network namespace."""
    folder = OUT / f"coredns-{request.param}"
    if request.param == "process":
        port, ready = _config(kube, folder, folder / "kubeconfig", os.getuid())
        with (folder / "coredns.log").open("wb") as log:
            process = subprocess.Popen(
                [str(COREDNS_BINARY), "-conf", str(folder / "Corefile")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            took = _wait_ready(
                f"http://127.0.0.1:{ready}/ready",
                lambda: process.poll() is None,
                lambda: (folder / "coredns.log").read_text(errors="replace"),
            )
            yield Server(port, took, process.pid)
        finally:
            process.terminate()
            process.wait(timeout=30)
        return
    skip_unless_runnable(IMAGE, "make cluster-images")
    port, ready = _config(kube, folder, Path("/etc/coredns/kubeconfig"), IMAGE_USER)
    container = Container(
        IMAGE,
        args=["-conf", "/etc/coredns/Corefile"],
        binds=[Bind(folder, "/etc/coredns")],
        log_path=folder / "container.log",
    )
    with container:
        assert container.config is not None
        assert container.config.user == f"{IMAGE_USER}:{IMAGE_USER}"
        container.start()
        took = _wait_ready(f"http://127.0.0.1:{ready}/ready", container.running, container.log)
        yield Server(port, took, None)


def ask(server: Server, name: str, rdtype: str = "A", tcp: bool = False) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype)
    send = dns.query.tcp if tcp else dns.query.udp
    return send(query, "127.0.0.1", port=server.port, timeout=5)


def addresses(answer: dns.message.Message) -> set[str]:
    return {rr.to_text() for rrset in answer.answer for rr in rrset if rrset.rdtype == 1}


def pod_resolver(server: Server, namespace: str) -> dns.resolver.Resolver:
    """A resolver configured as the kubelet writes a pod's resolv.conf (search list, ndots:5)."""
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = ["127.0.0.1"]
    resolver.port = server.port
    resolver.search = [
        dns.name.from_text(f"{suffix}{CLUSTER_DOMAIN}")
        for suffix in (f"{namespace}.svc.", "svc.", "")
    ]
    resolver.ndots = 5
    resolver.use_search_by_default = True
    resolver.lifetime = 5
    return resolver


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    name = f"dns-{secrets.token_hex(3)}"
    kube.run("create", "namespace", name)
    try:
        yield name
    finally:
        kube.run("delete", "namespace", name, "--wait=false", check=False)


def apply(kube: Kube, *objects: dict[str, Any]) -> None:
    items = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    kube.run("apply", "-f", "-", input=json.dumps(items))


def test_manifests_place_coredns_as_asked_and_forward_nowhere() -> None:
    assert ipaddress.ip_address(DNS_SERVICE_IP) in ipaddress.ip_network(SERVICE_RANGE)
    go_mod = (REPO / "cluster" / "tools" / "coredns" / "go.mod").read_text()
    assert f"github.com/coredns/coredns v{COREDNS_VERSION}" in go_mod
    toleration = {"key": "node.example/real", "operator": "Exists", "effect": "NoSchedule"}
    objects = manifests(
        "registry.example.com/coredns:1",
        namespace="dns",
        node_selector={"kubernetes.io/hostname": "real-0"},
        tolerations=[toleration],
    )
    by_kind = {o["kind"]: o for o in objects}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/hostname": "real-0"}
    assert toleration in pod["tolerations"]
    assert pod["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    assert by_kind["ClusterRoleBinding"]["subjects"][0]["namespace"] == "dns"
    default = {o["kind"]: o for o in manifests()}
    assert default["Service"]["metadata"]["namespace"] == "kube-system"
    assert (
        default["Deployment"]["spec"]["template"]["spec"]["containers"][0]
        | {
            "imagePullPolicy": "Never",
            "image": IMAGE,
        }
        == default["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    )
    assert "forward" not in default["ConfigMap"]["data"]["Corefile"]
    assert [(p["port"], p["targetPort"]) for p in default["Service"]["spec"]["ports"][:2]] == [
        (DNS_PORT, CONTAINER_DNS_PORT)
    ] * 2


def test_the_manifests_are_admitted_and_kube_dns_has_its_fixed_address(kube: Kube) -> None:
    service = kube.get("service", "kube-dns", "-n", "kube-system")
    assert service is not None and service["spec"]["clusterIP"] == DNS_SERVICE_IP
    # kwok schedules the pod and marks it Ready: admitted under the restricted standard, and
    # the Service's EndpointSlice names its DNS port.
    wait_for(
        "CoreDNS's Deployment to be available",
        lambda: (
            (kube.get("deployment", "coredns", "-n", "kube-system") or {})
            .get("status", {})
            .get("availableReplicas")
        ),
    )

    # The EndpointSlice controller is not the Deployment's: it fills the slice's ports a moment
    # after the pod is Ready, so the slice is waited for in its own right.
    def slice_ports() -> set[tuple[str, int]]:
        slices = kube.get(
            "endpointslices", "-n", "kube-system", "-l", "kubernetes.io/service-name=kube-dns"
        )
        items = (slices or {}).get("items", [])
        return {(p["name"], p["port"]) for s in items for p in s.get("ports") or []}

    wait_for(
        "kube-dns's EndpointSlice to name its DNS ports",
        lambda: {("dns", CONTAINER_DNS_PORT), ("dns-tcp", CONTAINER_DNS_PORT)} <= slice_ports(),
        detail=slice_ports,
    )


def test_service_names_resolve_to_their_cluster_ips(
    kube: Kube, server: Server, namespace: str
) -> None:
    apply(
        kube,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": namespace},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 8000}]},
        },
    )
    cluster_ip = kube.get("service", "web", "-n", namespace)["spec"]["clusterIP"]  # type: ignore[index]
    fqdn = f"web.{namespace}.svc.{CLUSTER_DOMAIN}"
    wait_for(f"{fqdn} to resolve", lambda: addresses(ask(server, fqdn)) == {cluster_ip})
    assert addresses(ask(server, fqdn, tcp=True)) == {cluster_ip}
    assert addresses(ask(server, f"kube-dns.kube-system.svc.{CLUSTER_DOMAIN}")) == {DNS_SERVICE_IP}
    assert addresses(ask(server, f"kubernetes.default.svc.{CLUSTER_DOMAIN}")) == {
        str(ipaddress.ip_network(SERVICE_RANGE)[1])
    }
    # The load test's default host, NAME.NAMESPACE.svc, and a bare name, as a pod looks them up.
    resolver = pod_resolver(server, namespace)
    for short in (f"web.{namespace}.svc", "web"):
        assert {rr.to_text() for rr in resolver.resolve(short, "A")} == {cluster_ip}
    srv = ask(server, f"_http._tcp.{fqdn}", "SRV")
    assert [rr.port for rrset in srv.answer for rr in rrset] == [8000]
    reverse = ask(server, dns.reversename.from_address(cluster_ip).to_text(), "PTR")
    assert [rr.to_text() for rrset in reverse.answer for rr in rrset] == [f"{fqdn}."]
    # The Corefile's `cache 30` keeps an answer up to 30 s, as in any cluster: a question not
    # asked before shows at once that the deletion reached CoreDNS.
    kube.run("delete", "service", "web", "-n", namespace)
    wait_for(
        f"{fqdn} to be gone once the Service is",
        lambda: ask(server, fqdn, "AAAA").rcode() == dns.rcode.NXDOMAIN,
    )


def test_a_headless_service_resolves_to_its_endpoint_slices_ready_addresses(
    kube: Kube, server: Server, namespace: str
) -> None:
    def endpoint(address: str, hostname: str, ready: bool) -> dict[str, Any]:
        return {"addresses": [address], "hostname": hostname, "conditions": {"ready": ready}}

    def endpoint_slice(name: str, *endpoints: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": "db"},
            },
            "addressType": "IPv4",
            "endpoints": list(endpoints),
            "ports": [{"name": "pg", "port": 5432, "protocol": "TCP"}],
        }

    apply(
        kube,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "db", "namespace": namespace},
            "spec": {"clusterIP": "None", "ports": [{"name": "pg", "port": 5432}]},
        },
        endpoint_slice(
            "db-a", endpoint("198.18.9.1", "db-0", True), endpoint("198.18.9.2", "db-1", True)
        ),
        endpoint_slice(
            "db-b", endpoint("198.18.9.3", "db-2", True), endpoint("198.18.9.4", "db-3", False)
        ),
    )
    fqdn = f"db.{namespace}.svc.{CLUSTER_DOMAIN}"
    ready = {"198.18.9.1", "198.18.9.2", "198.18.9.3"}
    wait_for(f"{fqdn} to resolve to {sorted(ready)}", lambda: addresses(ask(server, fqdn)) == ready)
    assert addresses(ask(server, f"db-0.{fqdn}")) == {"198.18.9.1"}
    srv = ask(server, f"_pg._tcp.{fqdn}", "SRV")
    assert sorted(rr.target.to_text() for rrset in srv.answer for rr in rrset) == [
        f"db-{i}.{fqdn}." for i in range(3)
    ]
    # A slice's change reaches CoreDNS: db-3 becomes ready, db-0 goes (asked with questions not
    # asked before, which the Corefile's `cache 30` holds no answer to).
    apply(
        kube,
        endpoint_slice("db-a", endpoint("198.18.9.2", "db-1", True)),
        endpoint_slice(
            "db-b", endpoint("198.18.9.3", "db-2", True), endpoint("198.18.9.4", "db-3", True)
        ),
    )
    wait_for(
        f"db-3.{fqdn} once ready", lambda: addresses(ask(server, f"db-3.{fqdn}")) == {"198.18.9.4"}
    )
    assert ask(server, f"db-0.{fqdn}", "AAAA").rcode() == dns.rcode.NXDOMAIN


def test_names_outside_the_cluster_fail_at_once(server: Server, namespace: str) -> None:
    for name, rdtype in (
        ("example.com", "A"),
        ("example.com", "AAAA"),
        (f"nothing.{namespace}.svc.{CLUSTER_DOMAIN}", "A"),
        (dns.reversename.from_address("192.0.2.1").to_text(), "PTR"),
    ):
        started = time.monotonic()
        answer = ask(server, name, rdtype)
        assert time.monotonic() - started < AT_ONCE_S
        assert answer.rcode() == dns.rcode.NXDOMAIN, (name, dns.rcode.to_text(answer.rcode()))
    # Through a pod's search list: four questions, every one answered NXDOMAIN at once.
    started = time.monotonic()
    with pytest.raises(dns.resolver.NXDOMAIN):
        pod_resolver(server, namespace).resolve("example.com", "A")
    assert time.monotonic() - started < AT_ONCE_S


def test_coredns_starts_fast_and_small_with_only_its_grants(kube: Kube, server: Server) -> None:
    assert server.ready_s < 10, f"ready after {server.ready_s:.1f} s"
    measured: dict[str, float] = {"ready_s": round(server.ready_s, 2)}
    if server.pid is not None:
        status = Path(f"/proc/{server.pid}/status").read_text()
        for field in ("VmRSS", "VmHWM"):
            match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
            assert match is not None
            measured[f"{field}_MiB"] = round(int(match.group(1)) / 1024, 1)
        assert measured["VmHWM_MiB"] < 170, "over the Deployment's memory limit"
    kind = "process" if server.pid is not None else "image"
    (OUT / f"measured-{kind}.json").write_text(json.dumps(measured) + "\n")
    # Every request of the manifests' ServiceAccount allowed: the ClusterRole is enough.
    with kube.cluster.audit_log.open("rb") as log:
        events = [json.loads(line) for line in log]
    ours = [e for e in events if e["user"]["username"] == SERVICE_ACCOUNT]
    assert ours, "no request of CoreDNS's ServiceAccount in the audit log"
    denied = [
        e["requestURI"]
        for e in ours
        if e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow"
    ]
    assert denied == []
    resources = {e["objectRef"]["resource"] for e in ours if "objectRef" in e}
    assert resources <= {"services", "endpointslices", "namespaces", "pods"}, resources
