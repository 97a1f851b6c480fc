"""Start, reuse and stop the local control plane (kwokctl's binary runtime, our own binaries).

Everything lives under one output folder (`out/cluster` from the Makefile):

- `kwok/`: kwokctl's work dir (`KWOK_WORKDIR`): its config, PKI, etcd data, pid files, logs;
- `kubeconfig`: the admin kubeconfig (client certificate from kwokctl's PKI);
- `node/`: the real node's state (cluster/node.py), when it runs or has run.

kwokctl is given every binary it runs as a local path, and every download prefix points at a
folder that does not exist, so a component we forgot fails at once instead of downloading.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.netns import (
    NODE_ADDRESS,
    SERVICE_RANGE,
    SIMULATED_POD_RANGE,
    HeldNamespace,
    netns_inode,
)
from cluster.node import NodeError, RealNode

REPO = Path(__file__).resolve().parent.parent
BIN_DIR = REPO / ".tools" / "bin"
CLUSTER_NAME = "arc-serving"
KUBE_VERSION = "v1.35.4"
NODE_NAMES = ("kwok-node-0", "kwok-node-1", "kwok-node-2")
# The annotation of the nodes kwok fakes (`fake`): the only ones its controller manages.
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# What each fake node advertises: enough for the chart's GPU engine (1 GPU, 4 CPUs, 32Gi each).
NODE_CAPACITY = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
# kwokctl's environment variable for each binary it runs, and the file in BIN_DIR.
BINARY_ENV = {
    "KWOK_ETCD_BINARY": "etcd",
    "KWOK_KUBE_APISERVER_BINARY": "kube-apiserver",
    "KWOK_KUBE_CONTROLLER_MANAGER_BINARY": "kube-controller-manager",
    "KWOK_KUBE_SCHEDULER_BINARY": "kube-scheduler",
    "KWOK_CONTROLLER_BINARY": "kwok",
    "KWOK_KUBECTL_BINARY": "kubectl",
}
# The daemons kwokctl runs, one process each, by the names it copies their binaries to.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok-controller",
)
# Download prefixes of components we do not give a binary for: a local folder that does not
# exist, so kwokctl fails with "no such file" rather than reaching for the internet.
NO_DOWNLOAD_PREFIX_ENV = (
    "KWOK_KUBE_BINARY_PREFIX",
    "KWOK_ETCD_BINARY_PREFIX",
    "KWOK_BINARY_PREFIX",
    "KWOK_PROMETHEUS_BINARY_PREFIX",
    "KWOK_METRICS_SERVER_BINARY_PREFIX",
    "KWOK_JAEGER_BINARY_PREFIX",
    "KWOK_KIND_BINARY_PREFIX",
)


# Each fake node's pods take their addresses from a /24 of SIMULATED_POD_RANGE (pod_cidr); the
# last /24 is the kwok controller's for a node without a podCIDR (its default is 10.0.0.0/24).
_POD_NET = ipaddress.ip_network(SIMULATED_POD_RANGE)
FALLBACK_POD_CIDR = str(list(_POD_NET.subnets(new_prefix=24))[-1])

# The API server's admission: its default plugins (`--kube-admission`) plus
# OwnerReferencesPermissionEnforcement, on by default in OpenShift: an owner reference with
# blockOwnerDeletion (kopf.adopt sets it) needs update on the owner's finalizers subresource.
# Its address: an explicit one, since a loopback-only network namespace has no default route to
# take it from, the real node's (which pods reach: cluster/node.py), and Services' addresses
# from a range local to that namespace (cluster/netns.py) instead of the default 10.0.0.0/24;
# the kwok controller's fallback pod range likewise. The scheduler and the controller manager
# run once each, so without leader election: an elected one exits when it cannot renew its
# Lease within 10 s (etcd stalled behind a large image import on a slow disk), and kwokctl's
# binary runtime never restarts it, which would leave every new pod Pending.
EXTRA_ARGS = (
    "kube-scheduler=leader-elect=false",
    "kube-controller-manager=leader-elect=false",
    "kube-apiserver=enable-admission-plugins=OwnerReferencesPermissionEnforcement",
    f"kube-apiserver=advertise-address={NODE_ADDRESS}",
    f"kube-apiserver=service-cluster-ip-range={SERVICE_RANGE}",
    f"kwok-controller=cidr={FALLBACK_POD_CIDR}",
)

# The API server's listening address: every address of the cluster's network namespace, which
# is loopback-only (cluster/netns.py), so that pods reach it at the real node's address.
API_SERVER_BIND = "0.0.0.0"  # nosec B104


def kwokctl_config(pki: Path) -> dict[str, Any]:
    """kwokctl's configuration for a cluster whose PKI kwokctl writes to ``pki``.

    Every component listens on the loopback address only (kwokctl's default, 0.0.0.0, would put
    an unauthenticated etcd on every interface of the machine), but the API server, which
    listens on every address of its loopback-only namespace: pods reach it through the
    `kubernetes` Service at the real node's address. Its certificate names that address and
    the Service's (KUBERNETES_SERVICE_HOST, which in-cluster clients dial). It reaches the
    kubelet (logs, exec) at the node's InternalIP, authenticated with kwokctl's admin
    certificate. The kwok controller manages only the nodes annotated as kwok's (kwokctl's
    binary runtime makes it manage every node, the real one included).
    """
    return {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokctlConfiguration",
        "options": {
            "bindAddress": "127.0.0.1",
            "kubeApiserverCertSANs": [NODE_ADDRESS, str(ipaddress.ip_network(SERVICE_RANGE)[1])],
        },
        "componentsPatches": [
            {
                "name": "kube-apiserver",
                "extraArgs": [
                    {"key": "bind-address", "value": API_SERVER_BIND, "override": True},
                    {"key": "kubelet-client-certificate", "value": str(pki / "admin.crt")},
                    {"key": "kubelet-client-key", "value": str(pki / "admin.key")},
                    {"key": "kubelet-preferred-address-types", "value": "InternalIP"},
                ],
            },
            {
                "name": "kwok-controller",
                "extraArgs": [
                    {"key": "manage-all-nodes", "value": "false", "override": True},
                    {
                        "key": "manage-nodes-with-annotation-selector",
                        "value": f"{KWOK_NODE_ANNOTATION}=fake",
                    },
                ],
            },
        ],
    }


def pod_cidr(index: int) -> str:
    """The pod CIDR of the fake node numbered ``index``: the index-th /24 of the simulated range."""
    subnets = _POD_NET.num_addresses // 256 - 1  # the last one is the fallback
    if not 0 <= index < subnets:
        raise ValueError(f"node index {index} outside 0..{subnets - 1}")
    return str(ipaddress.ip_network((int(_POD_NET.network_address) + 256 * index, 24)))


# The API server's audit policy: request metadata (user, verb, resource, decision, the
# `k8s.io/deprecated` annotation) of every service account's request, nothing of anybody else
# (the control plane and kubectl), into kwok/clusters/NAME/logs/audit.log.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


class ClusterError(RuntimeError):
    """The control plane did not come up or go down as asked."""


def node_manifest(name: str, index: int) -> dict[str, Any]:
    """A fake node kwok manages (annotation `kwok.x-k8s.io/node: fake`), as kwok's docs show,
    without the docs' NoSchedule taint: nothing real ever runs here, and the chart's pods do not
    tolerate it. Its pods' addresses come from ``pod_cidr(index)``."""
    cidr = pod_cidr(index)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", KWOK_NODE_ANNOTATION: "fake"},
            "labels": {
                "beta.kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/role": "agent",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
            },
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {
            "allocatable": dict(NODE_CAPACITY),
            "capacity": dict(NODE_CAPACITY),
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "",
                "containerRuntimeVersion": "kwok://fake",
                "kernelVersion": "fake",
                "kubeProxyVersion": "fake",
                "kubeletVersion": "fake",
                "machineID": "",
                "operatingSystem": "linux",
                "osImage": "kwok",
                "systemUUID": "",
            },
            "phase": "Running",
        },
    }


def _node_ready(node: Mapping[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@dataclass(frozen=True, init=False)
class LocalCluster:
    """The control plane whose state lives in `out` (kwokctl work dir and kubeconfig), and its
    real node (`real_node`, state in `out/node`), which `up` starts with it when built with
    ``real_node=True`` and stops otherwise; `down` stops both.

    The control plane is the same with or without the real node (`kwokctl_config`), so the node
    starts and stops on a running control plane.
    """

    out: Path
    bin_dir: Path
    name: str
    nodes: Sequence[str]
    # kwokctl's `--extra-args component=flag=value`.
    extra_args: Sequence[str]
    with_real_node: bool

    def __init__(
        self,
        out: Path,
        bin_dir: Path = BIN_DIR,
        name: str = CLUSTER_NAME,
        nodes: Sequence[str] = NODE_NAMES,
        extra_args: Sequence[str] = EXTRA_ARGS,
        real_node: bool = False,
    ) -> None:
        for key, value in (
            ("out", out),
            ("bin_dir", bin_dir),
            ("name", name),
            ("nodes", tuple(nodes)),
            ("extra_args", tuple(extra_args)),
            ("with_real_node", real_node),
        ):
            object.__setattr__(self, key, value)

    @property
    def real_node(self) -> RealNode:
        """The cluster's real node, running or not (`RealNode.running`)."""
        return RealNode(
            state=self.out.resolve() / "node",
            pki=self.cluster_dir / "pki",
            kubeconfig=self.kubeconfig,
            bin_dir=self.bin_dir,
        )

    @property
    def workdir(self) -> Path:
        return self.out.resolve() / "kwok"

    @property
    def kubeconfig(self) -> Path:
        return self.out.resolve() / "kubeconfig"

    @property
    def cluster_dir(self) -> Path:
        return self.workdir / "clusters" / self.name

    @property
    def audit_log(self) -> Path:
        """The API server's audit log: every service account's requests (AUDIT_POLICY)."""
        return self.cluster_dir / "logs" / "audit.log"

    @property
    def namespace(self) -> HeldNamespace:
        """The loopback-only network namespace `python -m cluster up` runs this cluster in."""
        return HeldNamespace(self.out.resolve() / "netns.pid")

    @property
    def kube_cache(self) -> Path:
        """kubectl's (and helm's) discovery and HTTP cache, instead of ~/.kube/cache."""
        return self.out.resolve() / "kube-cache"

    @property
    def config_path(self) -> Path:
        return self.out.resolve() / "kwokctl.yaml"

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    def client_env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """This process's environment for kubectl and helm against this cluster (the admin
        kubeconfig unless another is given), their caches and helm's folders under ``out``."""
        helm_home = self.out.resolve() / "helm"
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "KUBECACHEDIR": str(self.kube_cache),
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KWOK_WORKDIR"] = str(self.workdir)
        env["KWOK_KUBE_VERSION"] = KUBE_VERSION
        missing = [b for b in BINARY_ENV.values() if not (self.bin_dir / b).is_file()]
        if missing:
            raise ClusterError(
                f"missing binaries in {self.bin_dir}: {', '.join(missing)} (make cluster-binaries)"
            )
        for var, binary in BINARY_ENV.items():
            env[var] = str(self.bin_dir / binary)
        for var in NO_DOWNLOAD_PREFIX_ENV:
            env[var] = str(self.workdir / "no-downloads")
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.kube_cache)
        return env

    def kwokctl(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        self.out.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(kwokctl_config(self.cluster_dir / "pki"), indent=2))
        return subprocess.run(
            [
                str(self.bin_dir / "kwokctl"),
                "--config",
                str(self.config_path),
                "--name",
                self.name,
                *args,
            ],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args],
            env={**os.environ, "KUBECACHEDIR": str(self.kube_cache)},
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def answering(self) -> bool:
        """The kubeconfig exists and the API server says it is ready."""
        if not self.kubeconfig.is_file():
            return False
        try:
            result = self.kubectl("get", "--raw", "/readyz", "--request-timeout=5s", timeout=15)
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0 and result.stdout.strip() == "ok"

    def nodes_ready(self) -> bool:
        result = self.kubectl("get", "nodes", "-o", "json")
        if result.returncode != 0:
            return False
        by_name = {n["metadata"]["name"]: n for n in json.loads(result.stdout)["items"]}
        return all(name in by_name and _node_ready(by_name[name]) for name in self.nodes)

    def _wait(self, what: str, check: Any, deadline: float, interval: float = 0.5) -> None:
        while not check():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}; logs in {self.cluster_dir}/logs")
            time.sleep(interval)

    def up(self, timeout: float = 300) -> bool:
        """Start the cluster in this process's network namespace, or reuse one running there,
        and start or stop its real node as asked. True when the control plane was started
        here."""
        self._check_same_namespace()
        deadline = time.monotonic() + timeout
        if self.answering() and self.nodes_ready() and not self.stopped_components():
            self._converge_real_node(deadline)
            return False
        if self.cluster_dir.exists() or self.real_node.record.exists():
            # A stopped or broken cluster from an earlier run: start clean.
            self.down()
        self.out.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.unlink(missing_ok=True)
        audit_policy = self.out.resolve() / "audit-policy.yaml"
        audit_policy.write_text(AUDIT_POLICY)
        created = self.kwokctl(
            "create",
            "cluster",
            "--runtime",
            "binary",
            "--etcd-binary",
            str(self.bin_dir / "etcd"),
            "--kube-apiserver-binary",
            str(self.bin_dir / "kube-apiserver"),
            "--kube-controller-manager-binary",
            str(self.bin_dir / "kube-controller-manager"),
            "--kube-scheduler-binary",
            str(self.bin_dir / "kube-scheduler"),
            "--kwok-controller-binary",
            str(self.bin_dir / "kwok"),
            *(arg for extra in self.extra_args for arg in ("--extra-args", extra)),
            "--kube-authorization=true",
            "--kube-audit-policy",
            str(audit_policy),
            "--kube-admission=true",
            "--quiet-pull",
            "--kubeconfig",
            str(self.kubeconfig),
            "--wait",
            f"{int(timeout)}s",
            "--timeout",
            f"{int(timeout)}s",
            timeout=timeout + 30,
        )
        if created.returncode != 0:
            raise ClusterError(
                f"kwokctl create cluster failed ({created.returncode}):\n"
                f"{created.stdout}\n{created.stderr}"
            )
        self._check_no_downloads()
        self._wait("the API server's /readyz", self.answering, deadline)
        nodes = [node_manifest(n, i) for i, n in enumerate(self.nodes)]
        manifest = {"apiVersion": "v1", "kind": "List", "items": nodes}
        applied = self.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        if applied.returncode != 0:
            raise ClusterError(f"kubectl apply of the nodes failed:\n{applied.stderr}")
        self._wait("the kwok nodes to be Ready", self.nodes_ready, deadline)
        # The service account controller has run: namespaces get their default ServiceAccount.
        self._wait(
            "the default ServiceAccount",
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", "default").returncode == 0
            ),
            deadline,
        )
        self._converge_real_node(deadline)
        return True

    def _converge_real_node(self, deadline: float) -> None:
        """Start the real node if asked and not Ready, stop it if not asked and running."""
        node = self.real_node
        try:
            if self.with_real_node and not node.ready():
                node.start(timeout=max(deadline - time.monotonic(), 30))
            elif not self.with_real_node and node.record.exists():
                node.stop()
        except NodeError as error:
            raise ClusterError(f"real node {node.name}: {error}") from error

    def _check_no_downloads(self) -> None:
        cache = self.workdir / "cache"
        fetched = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
        if fetched:
            raise ClusterError(f"kwokctl downloaded something: {fetched}")

    def _check_same_namespace(self) -> None:
        """Refuse to touch this work dir's processes from another network namespace: they
        answer only inside their own, and kwokctl would kill them by their pid files."""
        ours = netns_inode()
        # The real node's holder is in the namespace the node was started from (its pods are
        # in namespaces of their own).
        held = self.real_node.holder()
        processes = [*self.pids(), *(held[:1] if held else ())]
        foreign = [pid for pid in processes if netns_inode(pid) not in (ours, None)]
        if foreign:
            raise ClusterError(
                f"the cluster in {self.out} runs in another network namespace (processes "
                f"{foreign}): run inside it (make cluster-shell -- COMMAND) or stop it first "
                "(make cluster-down)"
            )

    def _processes(self) -> dict[int, bytes]:
        """Processes running from this cluster's work dir (kwokctl's daemons), by /proc: their
        command lines."""
        marker = str(self.workdir).encode()
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline:
                found[int(entry.name)] = cmdline
        return found

    def pids(self) -> list[int]:
        """Processes running from this cluster's work dir (kwokctl's daemons), by /proc."""
        return sorted(self._processes())

    def stopped_components(self) -> list[str]:
        """The control plane's components (kwokctl starts one process of each) not running."""
        running = {
            Path(cmdline.split(b"\0", 1)[0].decode(errors="replace")).name
            for cmdline in self._processes().values()
        }
        return [name for name in COMPONENTS if name not in running]

    def down(self, timeout: float = 60) -> None:
        """Stop the real node (while the API server answers, so that its pods are deleted
        first), every component, and delete the cluster; no process of it is left behind."""
        self._check_same_namespace()
        node_error: NodeError | None = None
        try:
            self.real_node.stop(timeout=timeout)
        except NodeError as error:
            node_error = error  # the control plane goes down all the same
        if (self.bin_dir / "kwokctl").is_file() and self.cluster_dir.exists():
            self.kwokctl("delete", "cluster", "--kubeconfig", str(self.kubeconfig), timeout=timeout)
        deadline = time.monotonic() + timeout
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            stop = min(deadline, time.monotonic() + 10)
            while self.pids() and time.monotonic() < stop:
                time.sleep(0.2)
            if not self.pids():
                break
        left = self.pids()
        if left:
            raise ClusterError(f"processes still running after cluster-down: {left}")
        if node_error is not None:
            raise ClusterError(f"real node: {node_error}") from node_error
        self.kubeconfig.unlink(missing_ok=True)

    def write_token_kubeconfig(
        self, service_account: str, namespace: str, path: Path, duration: str = "2h"
    ) -> Path:
        """A kubeconfig that authenticates as `namespace/service_account` with a token from the
        TokenRequest API (`kubectl create token`), against the same server and CA."""
        token = self.kubectl(
            "create", "token", service_account, "-n", namespace, f"--duration={duration}"
        )
        if token.returncode != 0:
            raise ClusterError(f"kubectl create token failed: {token.stderr}")
        view = self.kubectl("config", "view", "--raw", "--minify", "--flatten", "-o", "json")
        if view.returncode != 0:
            raise ClusterError(f"kubectl config view failed: {view.stderr}")
        cluster = json.loads(view.stdout)["clusters"][0]["cluster"]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": self.name, "cluster": cluster}],
            "users": [
                {"name": f"{namespace}-{service_account}", "user": {"token": token.stdout.strip()}}
            ],
            "contexts": [
                {
                    "name": "sa",
                    "context": {
                        "cluster": self.name,
                        "user": f"{namespace}-{service_account}",
                        "namespace": namespace,
                    },
                }
            ],
            "current-context": "sa",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)
        return path
