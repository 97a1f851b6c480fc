"""`make cluster`, `make cluster-shell` and `make cluster-down` (`python -m cluster`): the
control plane in a loopback-only network namespace of its own, reached through it, its pods and
Services at addresses that exist only there, and every process of it stopped with it, also
after a start that failed half-way."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.local import NODE_NAMES, ClusterError, LocalCluster
from cluster.netns import SERVICE_RANGE, SIMULATED_POD_RANGE, HeldNamespace, processes_in
from tests.cluster.helpers import REPO, Kube, wait_for

pytestmark = pytest.mark.slow


def cluster_cli(out: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cluster", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def assert_nothing_left(namespace: HeldNamespace, inode: int, cluster: LocalCluster) -> None:
    assert processes_in(inode) == []
    assert cluster.pids() == []
    assert namespace.holder() is None and not namespace.pid_file.exists()


def test_up_shell_and_down_leave_no_process(tmp_path: Path) -> None:
    out = tmp_path / "cluster"
    cluster = LocalCluster(out=out, name="arc-netns")
    up = cluster_cli(out, "--name", cluster.name, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    held = cluster.namespace.holder()
    assert held is not None
    pid, inode = held
    try:
        assert f"in network namespace of holder {pid}" in up.stdout
        assert "make cluster-shell -- kubectl get nodes" in up.stdout
        # Every process of the cluster runs in the namespace, none in this one.
        assert cluster.pids() and set(cluster.pids()) <= set(processes_in(inode))
        nodes = cluster_cli(out, "--name", cluster.name, "shell", "--", "kubectl", "get", "nodes")
        assert nodes.returncode == 0, nodes.stderr
        assert all(f"{name}   Ready" in nodes.stdout for name in NODE_NAMES), nodes.stdout
        routes = cluster_cli(out, "shell", "--", "ip", "route", "show", "table", "all")
        assert "default" not in routes.stdout
        assert f"local {SIMULATED_POD_RANGE} dev lo" in routes.stdout
        # One scheduler and one controller manager, never elected: no Lease to lose when the
        # API server is slow, which would make either exit for good.
        assert cluster.stopped_components() == []
        leases = cluster_cli(out, "shell", "--", "kubectl", "get", "leases", "-A", "-o", "name")
        assert leases.returncode == 0, leases.stderr
        assert "kube-scheduler" not in leases.stdout
        assert "kube-controller-manager" not in leases.stdout
        # From here, outside the namespace, its API server does not answer.
        assert not cluster.answering()
        status = cluster_cli(out, "--name", cluster.name, "status")
        assert status.returncode == 0 and "answering" in status.stdout, status.stderr
        assert "not running:" not in status.stdout
        # A component that exits is named (a pod would wait Pending for a dead scheduler).
        scheduler = [p for p in cluster.pids() if b"kube-scheduler\0" in _cmdline(p)]
        assert len(scheduler) == 1, cluster.pids()
        os.kill(scheduler[0], signal.SIGKILL)
        wait_for(
            "the killed scheduler named",
            lambda: cluster.stopped_components() == ["kube-scheduler"],
            timeout=10,
            detail=cluster.stopped_components,
        )
        status = cluster_cli(out, "--name", cluster.name, "status")
        assert "not running: kube-scheduler" in status.stdout, status.stdout
        # A cluster running in another namespace is left alone by one started from here.
        with pytest.raises(ClusterError, match="runs in another network namespace"):
            cluster.up(timeout=30)
    finally:
        down = cluster_cli(out, "--name", cluster.name, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "no process left" in down.stdout
    assert_nothing_left(cluster.namespace, inode, cluster)


def test_down_after_a_failed_up_leaves_no_process(tmp_path: Path) -> None:
    """The API server refuses a flag it does not know and exits; etcd and the rest keep
    running in the namespace until `down`."""
    out = tmp_path / "cluster"
    cluster = LocalCluster(out=out, name="arc-broken")
    namespace = cluster.namespace
    pid, inode = namespace.start()
    try:
        start = (
            "from pathlib import Path; from cluster.local import LocalCluster; "
            f"LocalCluster(out=Path({str(out)!r}), name={cluster.name!r}, "
            "extra_args=('kube-apiserver=no-such-flag=1',)).up(timeout=20)"
        )
        failed = namespace.run(
            [sys.executable, "-c", start], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert failed.returncode != 0
        assert "ClusterError" in failed.stderr, failed.stderr
        left = set(processes_in(inode)) - {pid}
        assert left, "the failed start left nothing running to clean up"
    finally:
        down = cluster_cli(out, "--name", cluster.name, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert_nothing_left(namespace, inode, cluster)


def test_pods_and_services_get_addresses_that_exist_only_in_the_namespace(kube: Kube) -> None:
    """On the session's cluster: a simulated pod's address and a Service's are in the ranges
    local to the run's namespace, and a connection to the pod is refused at once."""
    name = f"addr-{time.monotonic_ns() % 100000}"
    kube.run("run", name, "--image=registry.example.com/none:1", "--restart=Never")
    try:
        pod_ip = wait_for(
            "the pod's address",
            lambda: ((kube.get("pod", name) or {}).get("status") or {}).get("podIP"),
        )
        assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(SIMULATED_POD_RANGE)
        service = kube.get("service", "kubernetes", "-n", "default") or {}
        cluster_ip = service["spec"]["clusterIP"]
        assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network(SERVICE_RANGE)
        start = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((pod_ip, 8000), timeout=10).close()
        assert time.monotonic() - start < 1.0
        nodes = json.loads(kube.run("get", "nodes", "-o", "json").stdout)["items"]
        for node in nodes:
            cidr = node["spec"].get("podCIDR")
            assert cidr and ipaddress.ip_network(cidr).subnet_of(
                ipaddress.ip_network(SIMULATED_POD_RANGE)
            ), node["metadata"]["name"]
    finally:
        kube.run("delete", "pod", name, "--wait=false", check=False)
