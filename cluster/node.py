"""The local cluster's real node: kubelet, containerd, runc, CNI and kube-proxy on this machine.

Pods scheduled on node ``REAL_NODE_NAME`` (labels ``REAL_NODE_LABELS``: ``type: real``, where
kwok's fake nodes say ``type: kwok``) run for real, from images imported into the node's
containerd (``RealNode.import_images``). The node joins the control plane of `cluster/local.py`
(kwokctl's), whose CA signs its client certificates.

Everything runs in the network namespace of the process that starts it, which must be loopback
only (cluster/netns.py), and in a mount namespace of its own, held by a process
(``unshare --mount --propagation private sleep infinity``); inside it:

- ``/`` is rshared (the kubelet's volume mounts must propagate into containers), ``/run`` a
  private tmpfs (containerd's sockets and shim state, pods' network namespace files, the
  xtables lock: paths containerd 1.6 hard-codes), ``/var/log`` a bind mount of ``logs/var-log``
  (the kubelet's hard-coded ``/var/log/pods`` and ``/var/log/containers``), ``/run/kubelet`` one
  of ``run/kubelet`` (the kubelet's root dir, on a path short enough for its unix sockets);
- files holding the kernel settings the kubelet requires are bind-mounted over their
  ``/proc/sys`` entries, and ``protectKernelDefaults`` makes it check them instead of writing
  them machine-wide;
- util-linux's mount keeps its table at ``LIBMOUNT_UTAB`` under the state folder, not in the
  host's ``/run/mount``.

The node's address ``NODE_ADDRESS`` is on ``lo``; pods are on bridge ``cni0`` with addresses from
``REAL_POD_RANGE``; kube-proxy (iptables, nft backend) routes Services to them. The pods' cgroups
are under a cgroup of the node's own (cgroupfs driver) in every hierarchy of this machine.

State lives under one folder (``OUT/node``): containerd's root there (its content store and
snapshots) outlives the node, so a later start finds the images imported before.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.dns import CLUSTER_DOMAIN, DNS_SERVICE_IP
from cluster.netns import NODE_ADDRESS, REAL_POD_RANGE, netns_inode

REPO = Path(__file__).resolve().parent.parent
# Debian's containerd, runc, CNI plugins, iptables and conntrack, unpacked (make cluster-binaries).
NODE_ROOT = REPO / ".tools" / "node-root"

REAL_NODE_NAME = "real-node-0"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
# The labels the node carries: the kubelet's own and `type: real` (kwok's nodes: `type: kwok`).
REAL_NODE_LABELS = {
    "beta.kubernetes.io/arch": _ARCH,
    "beta.kubernetes.io/os": "linux",
    "kubernetes.io/arch": _ARCH,
    "kubernetes.io/hostname": REAL_NODE_NAME,
    "kubernetes.io/os": "linux",
    "type": "real",
}
# The pod sandbox image: .tools/bin/pause (cluster/tools/pause) alone, written here at start.
PAUSE_IMAGE = "localhost/arc-serving/pause:local"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"  # inside the node's private /run
# The kubelet's root dir, inside the node's mount namespace: run/kubelet bound on a short path,
# since the kubelet makes unix sockets in it (108 bytes at most), and OUT may be a long path.
KUBELET_ROOT = "/run/kubelet"
K8S_NAMESPACE = "k8s.io"  # containerd's namespace for the CRI's images and containers
# What the kubelet checks with protectKernelDefaults (and otherwise writes machine-wide).
KERNEL_DEFAULTS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# The daemons, in the order they start (and stop in reverse).
DAEMONS = ("containerd", "kubelet", "kube-proxy")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Kubernetes' default ports: the kubelet's API on the node's address, its healthz and
# kube-proxy's metrics and healthz on 127.0.0.1. Fixed, so one real node per network namespace.
KUBELET_PORT = 10250
LOCAL_PORTS = KUBELET_HEALTHZ_PORT, PROXY_METRICS_PORT, PROXY_HEALTHZ_PORT = (10248, 10249, 10256)


class NodeError(RuntimeError):
    """The real node did not start, stop or take an image as asked."""


def cgroup_v2() -> bool:
    """This machine mounts the unified hierarchy alone at /sys/fs/cgroup (cgroup v2)."""
    return (CGROUP_ROOT / "cgroup.controllers").is_file()


def cgroup_mounts() -> list[Path]:
    """Every cgroup hierarchy mounted in this mount namespace (v1 controllers, v2 unified)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(fields[4]))
    return found


def pause_archive(binary: Path, reference: str, destination: Path) -> str:
    """Write a docker-archive of one layer holding ``binary`` as /pause, its entrypoint, and
    return its image ID (the config's digest). Same binary, same bytes, same ID."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        info.size, info.mode = binary.stat().st_size, 0o755
        with binary.open("rb") as data:
            tar.addfile(info, data)
    diff_id = "sha256:" + hashlib.sha256(layer.getvalue()).hexdigest()
    config = json.dumps(
        {
            "architecture": _ARCH,
            "os": "linux",
            "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        },
        sort_keys=True,
    ).encode()
    image_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        [{"Config": f"{image_id}.json", "RepoTags": [reference], "Layers": ["layer.tar"]}]
    ).encode()
    with tarfile.open(destination, mode="w") as archive:
        for name, content in (
            (f"{image_id}.json", config),
            ("layer.tar", layer.getvalue()),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), 0o644
            archive.addfile(info, io.BytesIO(content))
    return f"sha256:{image_id}"


def sweep_script(saved: str, prefixes: tuple[str, ...] = ("KUBE-", "CNI-")) -> str:
    """An ``iptables-restore --noflush`` script that deletes, from the rules ``iptables-save``
    printed, every chain named with one of ``prefixes`` and every other chain's rule jumping
    to one; empty when there is none."""
    script: list[str] = []
    table, deletions, chains = "", [], []
    for line in saved.splitlines():
        if line.startswith("*"):
            table, deletions, chains = line[1:], [], []
        elif line.startswith(":") and line[1:].startswith(prefixes):
            chains.append(line[1:].split()[0])
        elif line.startswith("-A ") and not line.split()[1].startswith(prefixes):
            if any(f" -j {prefix}" in line for prefix in prefixes):
                deletions.append("-D " + line[3:])
        elif line == "COMMIT" and (deletions or chains):
            # Flush every chain before deleting any: they jump to one another.
            script += [f"*{table}", *deletions, *(f"-F {c}" for c in chains)]
            script += [*(f"-X {c}" for c in chains), "COMMIT"]
    return "".join(f"{line}\n" for line in script)


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    """The process exists and has not exited: a zombie (a shim's, left to the machine's init to
    reap) holds nothing but its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _mnt_inode(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


# The daemons and holders this process started, by pid, until `stop` reaps them.
_STARTED: dict[int, subprocess.Popen[bytes]] = {}


@dataclass(frozen=True)
class RealNode:
    """One real node of the control plane whose PKI is ``pki`` and admin kubeconfig
    ``kubeconfig``, its state under ``state``.

    Invariants: while ``state/node.json`` exists it names the mount namespace holder (pid and
    namespace inode), the cgroup directories made and the daemons' pids; every process of the
    node is in that mount namespace (the daemons and containerd's shims) or in those cgroups
    (the pods' processes); nothing of the node is outside ``state`` but those cgroup
    directories, ``NODE_ADDRESS`` on lo, and the bridge and kube-proxy's rules in this network
    namespace, which `stop` removes (but the address, which the API server advertises). One
    real node per network namespace: its ports are fixed (``KUBELET_PORT``, ``LOCAL_PORTS``),
    and `start` refuses where they are taken.
    """

    state: Path
    pki: Path
    kubeconfig: Path
    bin_dir: Path
    root: Path = NODE_ROOT
    name: str = REAL_NODE_NAME

    # Paths.

    @property
    def record(self) -> Path:
        return self.state / "node.json"

    @property
    def containerd_root(self) -> Path:
        """containerd's content store, snapshots and metadata: kept across starts."""
        return self.state / "containerd"

    @property
    def logs(self) -> Path:
        """Each daemon's log (NAME.log) and the node's /var/log (var-log/pods: the pods')."""
        return self.state / "logs"

    @property
    def run(self) -> Path:
        """Everything else of one start (configuration, certificates, kubelet's root dir),
        made afresh each time."""
        return self.state / "run"

    @property
    def cgroup_name(self) -> str:
        """The node's cgroup (the kubelet's cgroupRoot) in every hierarchy, named after the
        state folder, so a node whose stop never ran is cleaned up by the next start."""
        return "arc-serving-node-" + hashlib.sha256(str(self.state).encode()).hexdigest()[:10]

    def env(self) -> dict[str, str]:
        """The daemons' environment: the unpacked tools first on PATH, their libraries."""
        libdirs = sorted(self.root.glob("usr/lib/*-linux-gnu"))
        if not libdirs or not (self.root / ".unpacked").is_file():
            raise NodeError(f"no unpacked node packages in {self.root} (make cluster-binaries)")
        path = [self.root / "usr" / "sbin", self.root / "usr" / "bin", self.bin_dir]
        return {
            **os.environ,
            "PATH": os.pathsep.join([*map(str, path), os.environ.get("PATH", "/usr/bin:/bin")]),
            "LD_LIBRARY_PATH": str(libdirs[0]),
            "XTABLES_LIBDIR": str(libdirs[0] / "xtables"),
            "LIBMOUNT_UTAB": str(self.state / "mount-utab"),
        }

    # What runs.

    def _read_record(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self.record.read_text()))
        except (OSError, ValueError):
            return None

    def holder(self) -> tuple[int, int] | None:
        """(pid, mount namespace inode) of the live holder, or None."""
        record = self._read_record()
        if record is None:
            return None
        pid, inode = record.get("holder"), record.get("mnt")
        if pid is None or inode is None:  # a start that failed before it made the holder
            return None
        return (pid, inode) if _mnt_inode(pid) == inode else None

    def processes(self) -> list[int]:
        """Every live process of the node: in its mount namespace (the holder included) or in
        its cgroups (the pods')."""
        record = self._read_record()
        if record is None:
            return []
        found = set()
        if record.get("mnt") is not None:
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and _mnt_inode(entry.name) == record["mnt"]:
                    found.add(int(entry.name))
        for directory in record.get("cgroups", []):
            for procs in Path(directory).rglob("cgroup.procs") if Path(directory).is_dir() else []:
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in procs.read_text().split())
        return sorted(found - {os.getpid()})

    def network_namespace(self) -> int | None:
        """The inode of the network namespace the node runs in, while its holder lives."""
        held = self.holder()
        return netns_inode(held[0]) if held else None

    def running(self) -> bool:
        """The holder and every daemon are alive."""
        held = self.holder()
        record = self._read_record()
        if held is None or record is None:
            return False
        daemons = record.get("daemons", {})
        return all(_mnt_inode(daemons.get(d, 0)) == held[1] for d in DAEMONS)

    def ready(self) -> bool:
        """The daemons run and the API server has the node Ready."""
        if not self.running():
            return False
        node = self.kubectl("get", "node", self.name, "-o", "json")
        if node.returncode != 0:
            return False
        conditions = json.loads(node.stdout).get("status", {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    # Commands.

    def kubectl(
        self, *args: str, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def inside(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` in the node's mount namespace."""
        held = self.holder()
        if held is None:
            raise NodeError(f"the node's mount namespace holder is not alive ({self.record})")
        return ["nsenter", f"--target={held[0]}", "--mount", "--", *argv]

    def ctr_argv(self, *args: str) -> list[str]:
        """The argv of containerd's own client, in the node's namespace, on the CRI's images
        and containers."""
        ctr = str(self.root / "usr" / "bin" / "ctr")
        return self.inside(
            [ctr, "--address", CONTAINERD_SOCKET, "--namespace", K8S_NAMESPACE, *args]
        )

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.ctr_argv(*args),
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _run(self, argv: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> str:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise NodeError(f"{what} failed ({' '.join(argv)}): {done.stderr.strip()}")
        return done.stdout

    # Start.

    def start(self, timeout: float = 120) -> None:
        """Start the node (anything left by an earlier start is stopped first) and wait until
        the API server has it Ready; a start that fails stops what it started (the logs stay)."""
        deadline = time.monotonic() + timeout
        if self.record.exists():
            self.stop()
        self._check_machine()
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.rmtree(self.logs, ignore_errors=True)
        for folder in (self.run, self.logs / "var-log", self.containerd_root):
            folder.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"daemons": {}}
        try:
            self._prepare_network()
            record["cgroups"] = [str(p) for p in self._make_cgroups()]
            self._save(record)
            record.update(zip(("holder", "mnt"), self._start_holder(), strict=True))
            self._save(record)
            self._prepare_mounts()
            configs = self._write_configs()
            record["daemons"]["containerd"] = self._spawn(
                "containerd", ["containerd", "--config", str(configs["containerd"])]
            )
            self._save(record)
            self._wait(
                "containerd", lambda: self.ctr("version", timeout=10).returncode == 0, deadline
            )
            self._import_pause()
            record["daemons"]["kubelet"] = self._spawn(
                "kubelet",
                [
                    str(self.bin_dir / "kubelet"),
                    f"--config={configs['kubelet']}",
                    f"--kubeconfig={configs['kubelet-kubeconfig']}",
                    f"--root-dir={KUBELET_ROOT}",
                    f"--hostname-override={self.name}",
                    f"--node-ip={NODE_ADDRESS}",
                    "--node-labels=type=real",
                    "--v=1",
                ],
            )
            record["daemons"]["kube-proxy"] = self._spawn(
                "kube-proxy",
                [str(self.bin_dir / "kube-proxy"), f"--config={configs['kube-proxy']}"],
            )
            self._save(record)
            self._wait(f"node {self.name} Ready", self.ready, deadline)
        except BaseException:
            self._save(record)
            with contextlib.suppress(NodeError):
                self.stop()
            raise

    def _check_machine(self) -> None:
        """Root, the binaries, and a network namespace with nothing but loopback: never the
        machine's own network, nor one where another real node runs (its bridge)."""
        if os.geteuid() != 0:
            raise NodeError(
                "the real node needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); without it: "
                "python -m cluster up --no-real-node"
            )
        missing = [
            b for b in ("kubelet", "kube-proxy", "pause") if not (self.bin_dir / b).is_file()
        ]
        if missing:
            raise NodeError(
                f"missing {', '.join(missing)} in {self.bin_dir} (make cluster-binaries)"
            )
        self.env()  # the unpacked packages
        # Through netlink: /sys/class/net shows the network namespace sysfs was mounted in.
        links = [
            line.split(":")[1].strip().split("@")[0]
            for line in self._run(["ip", "-o", "link", "show"], "ip link").splitlines()
        ]
        if "cni0" in links or not all(map(_port_free, LOCAL_PORTS)):
            raise NodeError(
                "another real node runs in this network namespace (bridge cni0, or one of the "
                f"ports {', '.join(map(str, LOCAL_PORTS))} of 127.0.0.1 taken)"
            )
        routes = self._run(["ip", "route", "show", "table", "all"], "ip route")
        if links != ["lo"] or any(line.startswith("default") for line in routes.splitlines()):
            raise NodeError(
                "the real node runs only in a loopback-only network namespace (cluster/netns.py);"
                f" this one has interfaces {links} or a default route"
            )

    def _prepare_network(self) -> None:
        """The node's address on lo; forwarding (a pod reaching a Service backed by another
        pod) and iptables on bridged traffic (the reply of a pod reached through a Service from
        a pod on the same bridge must be un-NATed), both settings of this namespace only."""
        addresses = self._run(["ip", "-4", "addr", "show", "dev", "lo"], "ip addr")
        if f" {NODE_ADDRESS}/32 " not in addresses:
            self._run(["ip", "addr", "add", f"{NODE_ADDRESS}/32", "dev", "lo"], "ip addr add")
        for key in ("ipv4/ip_forward", "bridge/bridge-nf-call-iptables"):
            Path("/proc/sys/net", key).write_text("1\n")

    def _make_cgroups(self) -> list[Path]:
        """The node's cgroup in every hierarchy; cpuset's needs its parent's CPUs and memory
        nodes before a process may join a child."""
        made = []
        for mount in cgroup_mounts():
            directory = mount / self.cgroup_name
            directory.mkdir(exist_ok=True)
            made.append(directory)
            for key in ("cpuset.cpus", "cpuset.mems"):
                if (mount / key).is_file():
                    (directory / key).write_text((mount / key).read_text())
            if (mount / "cgroup.subtree_control").is_file():
                wanted = (directory / "cgroup.controllers").read_text().split()
                (directory / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
        return made

    def _start_holder(self) -> tuple[int, int]:
        holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _STARTED[holder.pid] = holder
        ours = _mnt_inode("self")
        deadline = time.monotonic() + 10
        while (inode := _mnt_inode(holder.pid)) in (None, ours):
            if holder.poll() is not None or time.monotonic() > deadline:
                raise NodeError("unshare --mount made no mount namespace")
            time.sleep(0.01)
        assert inode is not None
        return holder.pid, inode

    def _prepare_mounts(self) -> None:
        env = self.env()
        fake = self.run / "proc-sys"
        (self.run / "kubelet").mkdir()
        commands = [
            ["mount", "--make-rshared", "/"],
            ["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/run"],
            ["mount", "--bind", str(self.logs / "var-log"), "/var/log"],
            ["mkdir", KUBELET_ROOT],
            ["mount", "--bind", str(self.run / "kubelet"), KUBELET_ROOT],
        ]
        for key, value in KERNEL_DEFAULTS.items():
            (fake / key).parent.mkdir(parents=True, exist_ok=True)
            (fake / key).write_text(value + "\n")
            commands.append(["mount", "--bind", str(fake / key), f"/proc/sys/{key}"])
        for command in commands:
            self._run(self.inside(command), "a mount in the node's namespace", env)

    def _client_certificate(self, name: str, user: str, group: str | None) -> Path:
        """A client certificate for ``user`` (in ``group``) signed by the cluster's CA, and a
        kubeconfig with it for the admin kubeconfig's server; the kubeconfig's path."""
        pki = self.run / "pki"
        pki.mkdir(exist_ok=True)
        key, csr, crt = (pki / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        subject = f"/O={group}/CN={user}" if group else f"/CN={user}"
        self._run(
            ["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
             "-subj", subject, "-out", str(csr)],
            "openssl req",
        )  # fmt: skip
        extensions = pki / f"{name}.ext"
        extensions.write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=clientAuth\n"
        )
        self._run(
            ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(self.pki / "ca.crt"),
             "-CAkey", str(self.pki / "ca.key"), "-set_serial", f"0x{os.urandom(16).hex()}",
             "-days", "3650", "-extfile", str(extensions), "-out", str(crt)],
            "openssl x509",
        )  # fmt: skip
        view = self.kubectl("config", "view", "--minify", "-o", "json")
        if view.returncode != 0:
            raise NodeError(f"kubectl config view failed: {view.stderr}")
        server = json.loads(view.stdout)["clusters"][0]["cluster"]["server"]
        kubeconfig = pki / f"{name}.kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {
                                "server": server,
                                "certificate-authority": str(self.pki / "ca.crt"),
                            },
                        }
                    ],
                    "users": [
                        {
                            "name": name,
                            "user": {"client-certificate": str(crt), "client-key": str(key)},
                        }
                    ],
                    "contexts": [{"name": name, "context": {"cluster": "local", "user": name}}],
                    "current-context": name,
                },
                indent=2,
            )
        )
        return kubeconfig

    def _write_configs(self) -> dict[str, Path]:
        """containerd's, the CNI network's, the kubelet's and kube-proxy's configuration."""
        config = self.run / "config"
        (config / "net.d").mkdir(parents=True)
        gateway = str(ipaddress.ip_network(REAL_POD_RANGE)[1])
        (config / "net.d" / "10-arc-serving.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "arc-serving",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": "cni0",
                            "isGateway": True,
                            # No route leaves the namespace: the pods' default route is the
                            # bridge, where kube-proxy's rules and the node's addresses are.
                            "isDefaultGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": REAL_POD_RANGE, "gateway": gateway}]],
                                "dataDir": str(self.run / "ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                },
                indent=2,
            )
        )
        containerd = config / "containerd.toml"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        containerd.write_text(
            f"""version = 2
root = "{self.containerd_root}"
state = "/run/containerd"
[grpc]
  address = "{CONTAINERD_SOCKET}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.run / "containerd-opt"}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # This machine may withhold CAP_SYS_RESOURCE: runc then cannot set the negative
  # oom_score_adj the kubelet asks for a sandbox (-998), and every sandbox fails to start.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  enable_cdi = false
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{self.root / "usr" / "sbin" / "runc"}"
  [{cri}.cni]
    bin_dir = "{self.root / "usr" / "lib" / "cni"}"
    conf_dir = "{config / "net.d"}"
    max_conf_num = 1
"""
        )
        resolv = config / "resolv.conf"
        # Pods with dnsPolicy Default: a lookup is refused at once (nothing answers there).
        resolv.write_text("nameserver 127.0.0.1\n")
        kubelet = config / "kubelet.json"
        kubelet_config: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_name}",
            "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
            "address": NODE_ADDRESS,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": KUBELET_HEALTHZ_PORT,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            # cluster/dns.py's Service; while none runs, a pod's lookup is refused at once.
            "clusterDomain": CLUSTER_DOMAIN,
            "clusterDNS": [DNS_SERVICE_IP],
            "resolvConf": str(resolv),
            "failSwapOn": False,
            # Check the kernel settings (faked in the mount namespace), never write them.
            "protectKernelDefaults": True,
            "serializeImagePulls": False,
            # There is no registry to pull an image from again: never collect one.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # The disk and memory are the machine's, shared: evict only when nearly out.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "500Mi",
                "imagefs.available": "500Mi",
                "nodefs.inodesFree": "1%",
            },
            # An image import fills the disk for a moment (buildah stages each layer in
            # /var/tmp): the pressure taint, which keeps every new pod Pending, goes 10 s
            # after the space is back instead of the default 5 min.
            "evictionPressureTransitionPeriod": "10s",
            # A ConfigMap edit reaches the files of a volume mounting it at the pod's next
            # sync (up to this period plus the kubelet's cache TTL); the default 1 min would
            # make a live policy switch take a minute on this node.
            "syncFrequency": "10s",
        }
        if not cgroup_v2():
            # Kubernetes 1.35 refuses cgroup v1 unless told otherwise; this machine has it.
            kubelet_config["failCgroupV1"] = False
        kubelet.write_text(json.dumps(kubelet_config, indent=2))
        proxy = config / "kube-proxy.json"
        proxy.write_text(
            json.dumps(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {
                        "kubeconfig": str(
                            self._client_certificate("kube-proxy", "system:kube-proxy", None)
                        )
                    },
                    "mode": "iptables",
                    "clusterCIDR": REAL_POD_RANGE,
                    "hostnameOverride": self.name,
                    "bindAddress": NODE_ADDRESS,
                    "metricsBindAddress": f"127.0.0.1:{PROXY_METRICS_PORT}",
                    "healthzBindAddress": f"127.0.0.1:{PROXY_HEALTHZ_PORT}",
                    "nodePortAddresses": ["primary"],
                    # Zero: leave the machine-wide conntrack table size and timeouts alone.
                    "conntrack": {
                        "maxPerCore": 0,
                        "min": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                },
                indent=2,
            )
        )
        return {
            "containerd": containerd,
            "kubelet": kubelet,
            # system:nodes and system:node:NAME: the Node authorizer and NodeRestriction apply.
            "kubelet-kubeconfig": self._client_certificate(
                "kubelet", f"system:node:{self.name}", "system:nodes"
            ),
            "kube-proxy": proxy,
        }

    def _spawn(self, name: str, argv: Sequence[str]) -> int:
        """Start a daemon in the node's mount namespace (nsenter execs it: same pid), its
        output in logs/NAME.log."""
        with (self.logs / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                self.inside(argv),
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _STARTED[process.pid] = process
        # nsenter joins the namespace, then execs: the pid is the daemon's once it is there.
        held = self.holder()
        assert held is not None  # self.inside() has found it
        while _mnt_inode(process.pid) != held[1]:
            if process.poll() is not None:
                raise NodeError(f"{name} exited at once; its log: {self.logs / name}.log")
            time.sleep(0.01)
        return process.pid

    def _save(self, record: Mapping[str, Any]) -> None:
        self.record.write_text(json.dumps(record, indent=2))

    def _wait(self, what: str, check: Any, deadline: float) -> None:
        """Poll ``check`` until it is true; fail at the deadline, or as soon as a daemon
        started has exited."""
        while not check():
            record = self._read_record() or {}
            daemons = record.get("daemons", {}).items()
            dead = [name for name, pid in daemons if _mnt_inode(pid) != record.get("mnt")]
            if dead:
                raise NodeError(f"{', '.join(dead)} exited; logs in {self.logs}")
            if time.monotonic() > deadline:
                raise NodeError(f"timed out waiting for {what}; logs in {self.logs}")
            time.sleep(0.2)

    # Images.

    def image_id(self, reference: str) -> str | None:
        """The ID (config digest) of the image containerd has under ``reference``, or None."""
        listed = self.ctr("images", "list", f"name=={reference}")
        rows = listed.stdout.splitlines()[1:]
        if listed.returncode != 0 or not rows:
            return None
        digest = rows[0].split()[2]
        manifest = json.loads(self.ctr("content", "get", digest).stdout)
        if "manifests" in manifest:  # an index: this platform's manifest
            (entry,) = [
                m
                for m in manifest["manifests"]
                if m.get("platform", {}).get("architecture") == _ARCH
            ]
            manifest = json.loads(self.ctr("content", "get", entry["digest"]).stdout)
        return str(manifest["config"]["digest"])

    def import_images(
        self, references: Sequence[str], timeout: float = 3600
    ) -> dict[str, float | None]:
        """Copy each image from buildah's storage into the node's containerd, where pods use it
        under the same reference (``imagePullPolicy: IfNotPresent``), unless containerd already
        has that image (the same ID: buildah's image ID is its config's digest, which containerd
        keeps); the seconds each import took, None for an image skipped. The archive streams
        through a FIFO: no copy of it on disk."""
        seconds: dict[str, float | None] = {}
        for reference in references:
            started = time.monotonic()
            wanted = self._run(
                ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}",
                 reference],
                f"buildah inspect {reference}",
            ).strip()  # fmt: skip
            if self.image_id(reference) == f"sha256:{wanted}":
                seconds[reference] = None
                continue
            with self._fifo(reference) as fifo:
                self._stream(
                    ["buildah", "push", "--quiet", reference, f"docker-archive:{fifo}:{reference}"],
                    fifo,
                    reference,
                    timeout,
                )
            if self.image_id(reference) != f"sha256:{wanted}":
                raise NodeError(f"containerd does not have {reference} as buildah's {wanted}")
            seconds[reference] = round(time.monotonic() - started, 1)
        return seconds

    def _import_pause(self) -> None:
        archive = self.run / "pause.tar"
        image_id = pause_archive(self.bin_dir / "pause", PAUSE_IMAGE, archive)
        if self.image_id(PAUSE_IMAGE) != image_id:
            imported = self.ctr("images", "import", str(archive))
            if imported.returncode != 0:
                raise NodeError(f"ctr images import of the pause image failed: {imported.stderr}")

    @contextlib.contextmanager
    def _fifo(self, reference: str) -> Iterator[Path]:
        fifo = self.run / f"import-{hashlib.sha256(reference.encode()).hexdigest()[:12]}"
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)
        try:
            yield fifo
        finally:
            fifo.unlink(missing_ok=True)

    def _stream(self, writer: Sequence[str], fifo: Path, reference: str, timeout: float) -> None:
        """Run ``writer`` (which writes a docker-archive into ``fifo``) beside ``ctr images
        import`` reading it: no copy of the archive on disk."""
        reader = subprocess.Popen(
            self.ctr_argv("images", "import", "--snapshotter", "overlayfs", str(fifo)),
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            written = subprocess.run(
                writer, capture_output=True, text=True, timeout=timeout, check=False
            )
            if written.returncode != 0:
                reader.kill()
                raise NodeError(f"{' '.join(writer)} failed: {written.stderr.strip()}")
            _, error = reader.communicate(timeout=timeout)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        if reader.returncode != 0:
            raise NodeError(f"ctr images import of {reference} failed: {error.strip()}")

    # Stop.

    def stop(self, timeout: float = 60) -> None:
        """Stop the node and remove everything of it but containerd's root and the logs:
        its pods (deleted through the API server while it answers, the node cordoned first so
        their controllers do not put them back here), kube-proxy and the kubelet, the pods'
        containers, containerd, whatever is left in the mount namespace or the cgroups, the
        bridge and kube-proxy's rules, the cgroups, the holder last, and the Node object.
        Fails naming what is left."""
        record = self._read_record()
        if record is None:
            return
        if self.network_namespace() not in (netns_inode(), None):
            # Its bridge and kube-proxy's rules are in that namespace, not in this one.
            raise NodeError(f"the node runs in another network namespace ({self.record})")
        deadline = time.monotonic() + timeout
        daemons: dict[str, int] = record.get("daemons", {})
        api = self.kubectl("get", "--raw", "/readyz", timeout=10).returncode == 0
        if api and self.running():
            self.kubectl("cordon", self.name)
            self.kubectl(
                "delete", "pods", "--all-namespaces", f"--field-selector=spec.nodeName={self.name}",
                "--grace-period=1", "--wait=true", f"--timeout={max(5, int(timeout / 2))}s",
                timeout=timeout,
            )  # fmt: skip
        mnt = record.get("mnt")
        for name in ("kube-proxy", "kubelet"):
            self._stop_pid(daemons.get(name), mnt, deadline)
        if _mnt_inode(daemons.get("containerd", 0)) == mnt:
            self._remove_containers()
        self._stop_pid(daemons.get("containerd"), mnt, deadline)
        if self.holder() is not None:
            # kube-proxy's rules: its own cleanup, with the xtables lock of the node's /run.
            subprocess.run(
                self.inside([str(self.bin_dir / "kube-proxy"), "--cleanup"]),
                env=self.env(),
                capture_output=True,
                timeout=60,
                check=False,
            )
            self._remove_chains()
        holder = self.holder()
        leftovers = [p for p in self.processes() if holder is None or p != holder[0]]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _signal(leftovers, sig)
            grace = min(deadline, time.monotonic() + 5)
            while any(map(_alive, leftovers)) and time.monotonic() < grace:
                time.sleep(0.1)
        subprocess.run(["ip", "link", "delete", "cni0"], capture_output=True, check=False)
        for directory in map(Path, record.get("cgroups", [])):
            for child in sorted(
                (p for p in directory.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
            ):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                directory.rmdir()
        if holder is not None:
            _signal([holder[0]], signal.SIGKILL)
        for pid in [*daemons.values(), *(holder[:1] if holder else ())]:
            if pid in _STARTED:
                _STARTED.pop(pid).wait()
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        if api:
            self.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false")
        left = self.processes()
        cgroups = [d for d in record.get("cgroups", []) if Path(d).exists()]
        if left or cgroups:
            raise NodeError(f"the real node left processes {left} and cgroups {cgroups}")
        self.record.unlink()

    def _remove_chains(self) -> None:
        """Delete what is left of the kubelet's iptables chains (KUBE-FIREWALL and its
        canaries; kube-proxy's went with its cleanup) and the CNI plugins', in both families."""
        for family in ("iptables", "ip6tables"):
            saved = subprocess.run(
                self.inside([f"{family}-save"]), env=self.env(), capture_output=True, text=True
            )
            script = sweep_script(saved.stdout) if saved.returncode == 0 else ""
            if script:
                subprocess.run(
                    self.inside([f"{family}-restore", "--noflush"]),
                    input=script,
                    env=self.env(),
                    capture_output=True,
                    text=True,
                    check=False,
                )

    def _stop_pid(self, pid: int | None, mnt: int | None, deadline: float) -> None:
        """SIGTERM a daemon (if it still is ours: in the node's mount namespace), SIGKILL it
        after 15 s."""
        if pid is None or _mnt_inode(pid) != mnt:
            return
        _signal([pid], signal.SIGTERM)
        grace = min(deadline, time.monotonic() + 15)
        while _mnt_inode(pid) == mnt and time.monotonic() < grace:
            time.sleep(0.1)
        _signal([pid], signal.SIGKILL)
        if pid in _STARTED:
            _STARTED.pop(pid).wait()

    def _remove_containers(self) -> None:
        """Kill every container's task and delete the containers, so that containerd's root,
        kept for its images, holds no container from this start."""
        tasks = self.ctr("tasks", "list", "--quiet").stdout.split()
        for task in tasks:
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task)
        for task in tasks:
            self.ctr("tasks", "delete", "--force", task)
        containers = self.ctr("containers", "list", "--quiet").stdout.split()
        if containers:
            self.ctr("containers", "delete", *containers)
