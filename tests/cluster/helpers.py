"""Helpers for tests/cluster: kubectl and helm bound to a kubeconfig, polling with a deadline,
the installed release, the host operator process (started, stopped, killed and restarted) and a
slow TCP link to the API server."""

from __future__ import annotations

import abc
import contextlib
import json
import os
import queue
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from arc_harness.vllm_server import free_port
from cluster.local import BIN_DIR, LocalCluster

REPO = Path(__file__).resolve().parents[2]
# The cluster's folder, the Makefile's CLUSTER_OUT; ARC_CLUSTER_OUT (relative to the repository
# or absolute) runs the tests on another, e.g. beside a cluster that runs in out/cluster.
OUT = REPO / os.environ.get("ARC_CLUSTER_OUT", "out/cluster")
CHART = REPO / "charts" / "arc-serving"
HELM = BIN_DIR / "helm"
# Deadlines sized for a slow, shared 2-core machine; the tests poll and return as soon as
# what they wait for is there.
START_TIMEOUT_S = 300.0
WAIT_S = 120.0
REGISTRY = "registry.example.com"
# The operator's finalizer on every ServingPolicy (arc_operator.FINALIZER).
FINALIZER = "arcserving.io/finalizer"
EXAMPLE = REPO / "operator" / "examples" / "servingpolicy-arc.yaml"
# The README's "Quick start on a cluster" install, every flag (the images' registry made up:
# kwok runs no container). The monitoring flags need the Prometheus Operator's CRDs, which
# `make cluster-crds` copies from its Go module into out/cluster/crds.
MONITORING_CRDS = OUT / "crds"
QUICK_START_SETS = (
    f"operator.image.registry={REGISTRY}",
    f"servingPolicy.image.registry={REGISTRY}",
    f"router.image.registry={REGISTRY}",
    f"loadtest.image.registry={REGISTRY}",
    "servingPolicy.model.name=Qwen/Qwen2.5-7B-Instruct",
    "servingPolicy.policy=TRIO",
    "servingPolicy.replicas=2",
    "ingress.enabled=true",
    "ingress.host=llm.example.com",
    "monitoring.podMonitor.enabled=true",
    "prometheusRule.enabled=true",
    "monitoring.podMonitor.labels.release=kube-prometheus-stack",
    "prometheusRule.labels.release=kube-prometheus-stack",
)
# Warnings from the API server or helm that would mean a deprecated or dropped API or field.
DEPRECATION = re.compile(r"deprecat|warning", re.IGNORECASE)
# client-go's log line when helm's --wait ends its own watch: about helm's client, not the API.
OWN_WATCH_ENDED = re.compile(
    r'reflector\.go:\d+\] "Warning: watch ended with error".*context canceled'
)


def api_warnings(output: str) -> list[str]:
    """The lines of helm's or kubectl's ``output`` that warn of a deprecated or dropped API or
    field (``DEPRECATION``), leaving out client-go's log of a watch helm itself ended."""
    return [line for line in output.splitlines()
            if DEPRECATION.search(line) and not OWN_WATCH_ENDED.search(line)]  # fmt: skip


T = TypeVar("T")
# make_policy(name, **spec): a ServingPolicy from the operator's example (conftest.py).
MakePolicy = Callable[..., dict[str, Any]]


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = WAIT_S,
    interval: float = 0.5,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` (and `detail()`,
    what was there instead) at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            seen = detail() if detail is not None else last
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; saw: {seen!r}")
        time.sleep(interval)


@dataclass(frozen=True)
class Kube:
    """kubectl and helm bound to one kubeconfig, with helm's folders under out/cluster."""

    cluster: LocalCluster
    kubeconfig: Path

    def env(self) -> dict[str, str]:
        return self.cluster.client_env(self.kubeconfig)

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.cluster.kubectl_path), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, *args: str) -> dict[str, Any] | None:
        """The object as JSON, or None when it does not exist."""
        result = self.run("get", *args, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            pytest.fail(f"kubectl get {' '.join(args)} failed: {result.stderr}")
        return json.loads(result.stdout)

    def apply(self, manifest: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("apply", "-f", "-", *args, input=json.dumps(manifest), check=False)

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(HELM), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )


def apply_monitoring_crds(kube: Kube) -> list[str]:
    """Apply the Prometheus Operator's CRDs (as kube-prometheus-stack installs them, from
    MONITORING_CRDS) and wait until they are established; their names."""
    files = sorted(MONITORING_CRDS.glob("*.yaml"))
    if not files:
        pytest.fail(f"no Prometheus Operator CRDs in {MONITORING_CRDS}: run `make cluster-crds`")
    names = []
    for path in files:
        kube.run("apply", "--server-side", "-f", str(path))
        names.append(yaml.safe_load(path.read_text(encoding="utf-8"))["metadata"]["name"])
    for name in names:
        kube.run("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return names


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    install: subprocess.CompletedProcess[str]

    @property
    def fullname(self) -> str:
        return f"{self.name}-arc-serving"


def helm_upgrade(kube: Kube, release: Release, *sets: str) -> None:
    """The README's `helm upgrade ... --reuse-values --set ...`, without `--wait` (helm 4 waits
    with kstatus, which holds a custom resource to its `Ready` condition, and Ready is not True
    where no pod serves /metrics): accepted, with no warning."""
    args = [a for value in sets for a in ("--set", value)]
    upgraded = kube.helm(
        "upgrade", release.name, str(CHART), "-n", release.namespace, "--reuse-values", *args
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert not api_warnings(upgraded.stdout + upgraded.stderr), upgraded.stderr


@dataclass
class HostOperator:
    """The chart's operator command (`argv`, `env`) run on this host as the chart's
    ServiceAccount; `start` runs it (again, after a stop or a kill), its output appended to
    `log`."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    kubeconfig: Path
    namespace: str
    metrics_port: int
    process: subprocess.Popen[bytes] = field(init=False, repr=False)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def running(self) -> bool:
        return hasattr(self, "process") and self.process.poll() is None

    def start(self) -> None:
        """Start the operator (again), in a process group of its own."""
        assert not self.running(), "the operator runs already"
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                self.argv,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
            )

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (kopf's graceful stop, then the Lease's release), SIGKILL after `timeout`
        seconds."""
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: no handler finishes, no cleanup runs."""
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)


def lease_identity(operator: HostOperator) -> str:
    """The operator's holderIdentity on its Lease (arc_operator.leadership, outside a pod)."""
    return f"{socket.gethostname()}_{operator.process.pid}"


def launch_operator(
    kube: Kube,
    namespace: str,
    deployment: str,
    log: Path,
    *,
    server: str | None = None,
    metrics_port: int | None = None,
) -> HostOperator:
    """Start the command and environment of operator Deployment `namespace/deployment` as a
    host process authenticated as its ServiceAccount with a fresh TokenRequest token (so the
    API server's audit log tells two such processes apart by the token's credential id); its
    kopf liveness endpoint and the pods' metrics port on free local ports, a 2-second status
    interval and a 1-second scrape timeout. `server` replaces the API server's URL. Outside a
    pod its identity on the release's Lease is `hostname_pid` (`lease_identity`)."""
    found = kube.get("deployment", deployment, "-n", namespace)
    assert found is not None, f"no deployment {namespace}/{deployment}"
    pod_spec = found["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    assert container["command"] == ["arc-operator"]
    kubeconfig = kube.cluster.write_token_kubeconfig(
        pod_spec["serviceAccountName"], namespace, log.with_suffix(".kubeconfig")
    )
    if server is not None:
        config = yaml.safe_load(kubeconfig.read_text(encoding="utf-8"))
        config["clusters"][0]["cluster"]["server"] = server
        kubeconfig.write_text(json.dumps(config), encoding="utf-8")
    args = [
        a if not a.startswith("--liveness=") else f"--liveness=http://127.0.0.1:{free_port()}/h"
        for a in container["args"]
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARC_OPERATOR_")}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    port = metrics_port if metrics_port is not None else free_port()
    env.update(
        KUBECONFIG=str(kubeconfig),
        ARC_OPERATOR_STATUS_INTERVAL="2",
        ARC_OPERATOR_SCRAPE_TIMEOUT="1",
        ARC_OPERATOR_METRICS_PORT=str(port),
    )
    log.write_bytes(b"")
    operator = HostOperator(
        [sys.executable, "-m", "arc_operator", *args], env, log, kubeconfig, namespace, port
    )
    operator.start()
    return operator


@contextlib.contextmanager
def operator_paused(operator: HostOperator) -> Iterator[None]:
    """The session's operator stopped (gracefully) for the block and started again after it,
    so that only the operators the block starts act on ServingPolicies."""
    operator.stop()
    try:
        yield
    finally:
        operator.start()


def api_server_address(kube: Kube) -> tuple[str, str, int]:
    """The API server's URL, host and port, from the admin kubeconfig."""
    view = kube.run("config", "view", "--minify", "-o", "jsonpath={.clusters[0].cluster.server}")
    url = view.stdout.strip()
    host, _, port = url.removeprefix("https://").rstrip("/").rpartition(":")
    return url, host, int(port)


class SlowLink:
    """A TCP relay on 127.0.0.1 to the API server that holds every chunk a client sends for
    `delay` seconds before passing it on (TLS passes through untouched: the server's
    certificate names 127.0.0.1, whatever the port), so each request of a client behind it
    takes at least `delay`. `cut()` closes every connection and drops what it still holds,
    as a crash of the client would leave it."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream, self.delay = upstream, delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, slow: bool) -> None:
        # A socket that cut() closed before its pump registered it has no descriptor left:
        # the selector refuses it with ValueError, and the pump has nothing to do.
        with contextlib.suppress(OSError, ValueError), selectors.DefaultSelector() as sel:
            sel.register(source, selectors.EVENT_READ)
            while not self._closed.is_set():
                if not sel.select(timeout=0.5):
                    continue
                chunk = source.recv(65536)
                if not chunk:
                    break
                if slow and self._closed.wait(self.delay):
                    break
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()


def condition(sp: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in sp.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return {}


def reported(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    """The ServingPolicy once the operator has reported on its current generation."""
    sp = kube.get("servingpolicy", name, "-n", ns)
    if sp and sp.get("status", {}).get("observedGeneration") == sp["metadata"]["generation"]:
        return sp
    return None


def configured_policy(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    """The policy file in ServingPolicy ``name``'s ConfigMap, parsed (None while it is absent)."""
    configmap = kube.get("configmap", f"{name}-policy", "-n", ns)
    return None if configmap is None else json.loads(configmap["data"]["policy.json"])


def ready_pods_matching(kube: Kube, ns: str, selector: str) -> list[dict[str, Any]]:
    """The pods of ``selector`` in ``ns`` that are Ready and not being deleted."""
    pods = kube.get("pods", "-n", ns, "-l", selector)
    return [
        p
        for p in (pods or {}).get("items", [])
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p.get("status", {}).get("conditions", [])
        )
    ]


def ready_pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    """The ServingPolicy ``name``'s vLLM pods that are Ready."""
    selector = f"arcserving.io/servingpolicy={name},app.kubernetes.io/component=serving"
    return ready_pods_matching(kube, ns, selector)


def patch(kube: Kube, ns: str, name: str, spec: dict[str, Any]) -> None:
    kube.run(
        "patch",
        "servingpolicy",
        name,
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": spec}),
    )


class KubectlStream(abc.ABC):
    """A long-running kubectl command whose output lines are handed to ``on_line`` as they
    come, on a reader thread."""

    def __init__(self, kube: Kube, *args: str) -> None:
        self._process = subprocess.Popen(
            [str(kube.cluster.kubectl_path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=kube.env(),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self.on_line(line)

    @abc.abstractmethod
    def on_line(self, line: str) -> None:
        """Take one line of output (called on the reader thread)."""

    def close(self) -> None:
        self._process.kill()
        self._process.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self._process.stdout is not None
        self._process.stdout.close()


class Watch(KubectlStream):
    """`kubectl get KIND --watch -o name` in a namespace, its lines read as they come."""

    def __init__(self, kube: Kube, kind: str, namespace: str) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        super().__init__(kube, "get", kind, "-n", namespace, "--watch", "-o", "name")

    def on_line(self, line: str) -> None:
        self._lines.put(line.strip())

    def wait_line(self, what: str, match: Callable[[str], bool], timeout: float = WAIT_S) -> str:
        """The first line (from now on) that `match`es; fails naming `what` at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"timed out after {timeout:.0f} s watching for {what}")
            if match(line):
                return line


class RawWatch(KubectlStream):
    """`kubectl get --raw PATH?watch=1`: the API server's watch events (one JSON per line)
    collected in ``events`` as they come, the first ones describing the objects that exist."""

    def __init__(self, kube: Kube, path: str) -> None:
        self.events: list[dict[str, Any]] = []
        super().__init__(kube, "get", "--raw", path)

    def on_line(self, line: str) -> None:
        self.events.append(json.loads(line))


def audit_offset(kube: Kube) -> int:
    """The audit log's length now: `audit_events(kube, offset)` reads what comes after."""
    return kube.cluster.audit_log.stat().st_size


def audit_events(kube: Kube, offset: int, username: str) -> list[dict[str, Any]]:
    """The audit events of `username` logged after `offset`."""
    with kube.cluster.audit_log.open("rb") as log:
        log.seek(offset)
        lines = log.read().decode().splitlines()
    return [e for line in lines if (e := json.loads(line))["user"]["username"] == username]


def credential(event: dict[str, Any]) -> str:
    """The token an audit event's request came with (its JTI): one per `launch_operator`."""
    return str(event["user"].get("extra", {}).get("authentication.kubernetes.io/credential-id"))
