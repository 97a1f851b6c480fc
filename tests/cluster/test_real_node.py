"""The local cluster's real node (cluster/node.py): kubelet, containerd, runc, the CNI bridge and
kube-proxy beside kwok's nodes, on a control plane of its own in this run's network namespace.

A pod from one of the project's images, imported from buildah's storage, becomes Ready through
its own httpGet probe; `kubectl logs` and `kubectl exec` reach it; a ClusterIP Service reaches it
from this process and from another pod; a pod authenticates to the API server through the
`kubernetes` Service with its ServiceAccount token, the server's certificate verified. The tests
run in the order written; the last stops the cluster and checks that nothing of the node is left:
no process, mount, mount namespace, cgroup, bridge or kube-proxy rule.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.images import ImagesNotBuilt, built_references
from cluster.local import NODE_NAMES, LocalCluster
from cluster.netns import NODE_ADDRESS, REAL_POD_RANGE, SERVICE_RANGE
from cluster.node import REAL_NODE_LABELS, REAL_NODE_NAME, NodeError, RealNode, cgroup_mounts
from tests.cluster.helpers import REPO, START_TIMEOUT_S, Kube, wait_for

pytestmark = pytest.mark.slow

OUT = REPO / "out" / "cluster-real-node"
NAME = "arc-real-node"
NAMESPACE = "real-node"
PORT = 8080


def image() -> str:
    """The operator image as `make images-local` built it: the smallest with a Python."""
    try:
        return built_references(["operator"])["operator"]
    except ImagesNotBuilt as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def control_plane() -> Iterator[LocalCluster]:
    """A control plane of its own (in place of conftest.py's shared one, whose tests expect
    kwok's nodes only), without its real node."""
    local = LocalCluster(out=OUT, name=NAME)
    try:
        local.up(timeout=START_TIMEOUT_S)
        yield local
    finally:
        local.down()


@pytest.fixture(scope="module")
def cluster(control_plane: LocalCluster) -> LocalCluster:
    """The same control plane with its real node started, the operator image imported."""
    local = LocalCluster(out=OUT, name=NAME, real_node=True)
    assert not local.up(timeout=START_TIMEOUT_S)  # the control plane reused
    local.real_node.import_images([image()])
    Kube(local, local.kubeconfig).run("create", "namespace", NAMESPACE)
    return local


@pytest.fixture(scope="module")
def kube(cluster: LocalCluster) -> Kube:
    return Kube(cluster, cluster.kubeconfig)


def ready(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None


def run_pod(kube: Kube, name: str, command: list[str], **container: Any) -> dict[str, Any]:
    """A pod on the real node running ``command`` in the operator image, once Ready."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {"type": "real"},
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": name,
                    "image": image(),
                    "imagePullPolicy": "IfNotPresent",
                    "command": command,
                    **container,
                }
            ],
        },
    }
    kube.run("apply", "-f", "-", input=json.dumps(manifest))
    return wait_for(
        f"pod {name} Ready",
        lambda: ready(kube.get("pod", name, "-n", NAMESPACE)),
        detail=lambda: kube.run("describe", "pod", name, "-n", NAMESPACE, check=False).stdout,
    )


@pytest.fixture(scope="module")
def web(kube: Kube) -> dict[str, Any]:
    """`python -m http.server` in a pod, Ready when its httpGet probe answers, behind a
    ClusterIP Service."""
    probe = {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1}
    pod = run_pod(
        kube,
        "web",
        ["python", "-m", "http.server", str(PORT)],
        readinessProbe=probe,
        ports=[{"containerPort": PORT}],
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": NAMESPACE},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": PORT}]},
    }
    kube.run("apply", "-f", "-", input=json.dumps(service))
    # kube-proxy programs a new Service some moments after its EndpointSlice: until then
    # its address is refused.
    wait_for(
        "kube-proxy's rules for Service web",
        lambda: proxied(kube, service_ip(kube), pod["status"]["podIP"]),
        timeout=START_TIMEOUT_S,
        detail=lambda: node_rules(kube),
    )
    return pod


@pytest.fixture(scope="module")
def client(kube: Kube) -> dict[str, Any]:
    return run_pod(kube, "client", ["sleep", "infinity"])


def service_ip(kube: Kube) -> str:
    service = kube.get("service", "web", "-n", NAMESPACE)
    assert service is not None
    return str(service["spec"]["clusterIP"])


def node_rules(kube: Kube) -> str:
    """The node's iptables rules, as kube-proxy wrote them (nft backend)."""
    env = kube.cluster.real_node.env()
    return subprocess.run(["iptables-save"], env=env, capture_output=True, text=True).stdout


def proxied(kube: Kube, address: str, pod_ip: str) -> bool:
    """kube-proxy sends ``address`` to a Service chain and has a DNAT to ``pod_ip``."""
    rules = node_rules(kube).splitlines()
    to_service = any(f"-d {address}/32" in r and "-j KUBE-SVC-" in r for r in rules)
    to_pod = any(f"--to-destination {pod_ip}:{PORT}" in r for r in rules)
    return to_service and to_pod


def exec_python(kube: Kube, pod: str, code: str) -> str:
    return kube.run("exec", pod, "-n", NAMESPACE, "--", "python", "-c", code).stdout.strip()


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has released all but its pid)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def node_processes(node: RealNode) -> list[int]:
    """The processes started from this one into another mount namespace (the node's holder
    and daemons were) or naming the node's state folder (containerd's shims do)."""
    ours = os.stat("/proc/self/ns/mnt").st_ino
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            elsewhere = entry.joinpath("ns", "mnt").stat().st_ino != ours
            named = str(node.state).encode() in entry.joinpath("cmdline").read_bytes()
        except OSError:  # the process has exited
            continue
        if (parent == os.getpid() and elsewhere) or named:
            found.append(int(entry.name))
    return found


def mount_namespaces() -> set[int]:
    """The inode of every process's mount namespace."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*/ns/mnt"):
        try:
            found.add(entry.stat().st_ino)
        except OSError:  # the process has exited
            continue
    return found


def assert_nothing_left(node: RealNode) -> None:
    """Nothing of the node: no process started from here or naming its state folder, mount,
    cgroup, bridge, pod route or iptables chain of the kubelet's or kube-proxy's."""
    assert not node.record.exists() and node.processes() == []
    # Exited: the shims' zombies are the machine's init's to reap (they are its children).
    assert not [pid for pid in node_processes(node) if running(pid)]
    assert str(node.state) not in Path("/proc/self/mountinfo").read_text()
    assert not [m for m in cgroup_mounts() if (m / node.cgroup_name).exists()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert "cni0" not in links and "veth" not in links
    routes = subprocess.run(["ip", "route", "show", "table", "all"], capture_output=True, text=True)
    assert REAL_POD_RANGE not in routes.stdout
    # The chains, as the iptables the node used (nft backend) lists them.
    rules = subprocess.run(["iptables-save"], env=node.env(), capture_output=True, text=True)
    assert rules.returncode == 0 and "KUBE-" not in rules.stdout, rules.stdout


def test_a_start_whose_kubelet_exits_fails_and_leaves_nothing(
    control_plane: LocalCluster, tmp_path: Path
) -> None:
    """The node's binaries but a kubelet that exits at once: the start fails naming it, having
    stopped what it started; its log stays."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for binary in control_plane.bin_dir.iterdir():
        (bin_dir / binary.name).symlink_to(binary)
    (bin_dir / "kubelet").unlink()
    (bin_dir / "kubelet").write_text("#!/bin/sh\necho kubelet refuses to start >&2\nexit 1\n")
    (bin_dir / "kubelet").chmod(0o755)
    node = dataclasses.replace(control_plane.real_node, bin_dir=bin_dir)
    with pytest.raises(NodeError, match="kubelet exited"):
        node.start(timeout=60)
    assert "kubelet refuses to start" in (node.logs / "kubelet.log").read_text()
    assert "containerd successfully booted" in (node.logs / "containerd.log").read_text()
    assert_nothing_left(node)


def test_the_node_is_ready_beside_kwoks_with_its_labels(kube: Kube) -> None:
    nodes = {n["metadata"]["name"]: n for n in (kube.get("nodes") or {})["items"]}
    assert set(nodes) == {*NODE_NAMES, REAL_NODE_NAME}
    assert all(ready(node) for node in nodes.values())
    node = nodes[REAL_NODE_NAME]
    assert node["metadata"]["labels"].items() >= REAL_NODE_LABELS.items()
    assert all(nodes[name]["metadata"]["labels"]["type"] == "kwok" for name in NODE_NAMES)
    assert {"type": "InternalIP", "address": NODE_ADDRESS} in node["status"]["addresses"]
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.35.4"
    assert info["containerRuntimeVersion"].startswith("containerd://")


def test_a_pod_is_ready_through_its_http_probe_with_logs_and_exec(
    kube: Kube, web: dict[str, Any]
) -> None:
    assert web["spec"]["nodeName"] == REAL_NODE_NAME
    assert ipaddress.ip_address(web["status"]["podIP"]) in ipaddress.ip_network(REAL_POD_RANGE)
    logs = kube.run("logs", "web", "-n", NAMESPACE).stdout
    assert f"Serving HTTP on 0.0.0.0 port {PORT}" in logs
    # The kubelet's probes, from the bridge's address.
    assert '"GET / HTTP/1.1" 200' in logs, logs
    user = kube.run("exec", "web", "-n", NAMESPACE, "--", "id", "-un").stdout.strip()
    assert user == "arc-operator"


def test_a_cluster_ip_service_reaches_the_pod_from_here_and_from_a_pod(
    kube: Kube, web: dict[str, Any], client: dict[str, Any]
) -> None:
    address = service_ip(kube)
    assert ipaddress.ip_address(address) in ipaddress.ip_network(SERVICE_RANGE)
    with urllib.request.urlopen(f"http://{address}/", timeout=10) as answer:
        assert answer.status == 200
    code = f"import urllib.request; print(urllib.request.urlopen('http://{address}/').status)"
    assert exec_python(kube, "client", code) == "200"
    # And pod to pod, by address.
    url = f"http://{web['status']['podIP']}:{PORT}/"
    code = f"import urllib.request; print(urllib.request.urlopen('{url}').status)"
    assert exec_python(kube, "client", code) == "200"


SELF_SUBJECT_REVIEW = """
import json, os, ssl, urllib.request
account = "/var/run/secrets/kubernetes.io/serviceaccount"
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
request = urllib.request.Request(
    f"https://{host}:{port}/apis/authentication.k8s.io/v1/selfsubjectreviews",
    data=b'{"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}',
    headers={"Authorization": "Bearer " + open(account + "/token").read(),
             "Content-Type": "application/json"},
)
context = ssl.create_default_context(cafile=account + "/ca.crt")
review = json.load(urllib.request.urlopen(request, context=context, timeout=10))
print(host, review["status"]["userInfo"]["username"])
"""


def test_a_pod_reaches_the_api_server_with_its_service_account_token(
    kube: Kube, client: dict[str, Any]
) -> None:
    """Through the `kubernetes` Service (its first address, which the server's certificate
    names), verified against the CA the pod mounts; the API server says who the token is."""
    host, user = exec_python(kube, "client", SELF_SUBJECT_REVIEW).split()
    assert host == str(ipaddress.ip_network(SERVICE_RANGE)[1])
    assert user == f"system:serviceaccount:{NAMESPACE}:default"


def test_an_image_containerd_has_is_not_imported_again(cluster: LocalCluster) -> None:
    assert cluster.real_node.import_images([image()]) == {image(): None}


def test_down_leaves_no_process_mount_namespace_or_cgroup(
    cluster: LocalCluster, web: dict[str, Any], client: dict[str, Any]
) -> None:
    node = cluster.real_node
    record = json.loads(node.record.read_text())
    processes = node.processes()
    # The holder, the daemons, a shim and two processes (sandbox and container) of each pod.
    assert record["holder"] in processes and len(processes) >= 1 + len(record["daemons"]) + 6
    cluster.down()
    assert not [pid for pid in processes if running(pid)]
    assert record["mnt"] not in mount_namespaces()
    assert not [d for d in record["cgroups"] if Path(d).exists()]
    assert_nothing_left(node)
