"""``python -m cluster.bench`` (``make bench-cluster``): the operator at a hundred
ServingPolicies on the local Kubernetes 1.35 control plane (cluster/README.md).

It starts (or reuses) a control plane of its own under ``--out`` (kwokctl cluster
``arc-bench``, never ``out/cluster``) in that folder's loopback-only network namespace
(cluster/netns.py; stopped at the end unless ``--keep-cluster``), adds kwok nodes for every
simulated pod, installs the chart without its default ServingPolicy and runs the chart's
operator command on this host as the chart's ServiceAccount (a TokenRequest token), as
tests/cluster does. Then, in three phases, it prints figures (no pass or fail):

1. create: ``kubectl apply --server-side`` of one file with ``--policies`` ServingPolicies of
   ``--replicas`` pods each (the operator's example, kv_aware routing: one router per policy),
   and the time until every policy has converged (the milestones below);
2. steady: a ``--window`` of seconds with nothing changing: the operator's requests and how
   many of its writes changed an object;
3. delete: ``--delete-fraction`` of the serving pods deleted at once, and the time until every
   router lists the right workers again and every Deployment is back to its ready replicas.

Milestones, each for every ServingPolicy (kwok runs no container, so no pod serves /metrics:
``PolicyApplied`` and ``Ready`` stay Unknown, ``MetricsUnavailable``; these are reachable):

- ``status observed``: ``status.observedGeneration`` is ``metadata.generation``;
- ``pods ready``: the serving Deployment observed its generation and has ``--replicas``
  replicas, all updated and ready, and that many ready pods exist (none being deleted);
- ``router workers``: the router Deployment's ``--worker-urls`` are exactly the ready pods'
  addresses (what the operator writes);
- ``router rolled out``: and the Deployment controller has rolled that out (observed, every
  router replica updated and ready: the cluster's part);
- ``status ready``: ``status.readyReplicas`` is ``--replicas`` and ``Valid`` and
  ``RouterReady`` are True (written by the status timer, so bounded by its interval).

Sources: the operator's own requests from the API server's audit log (kwok work dir,
``logs/audit.log``; every service account's requests at Metadata level), every client's from
the API server's ``apiserver_request_total`` (``/metrics``, admin credentials), writes that
changed an object from watches of the namespace (a write that changes nothing makes no
event), and the operator process's CPU time and peak RSS from ``/proc``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import yaml
from prometheus_client.parser import text_string_to_metric_families

from arc_harness.vllm_server import free_port
from arc_operator import manifests as mf
from arc_operator.manifests.common import PORT
from cluster.local import NODE_NAMES, REPO, LocalCluster, node_manifest

CHART = REPO / "charts" / "arc-serving"
EXAMPLE = REPO / "operator" / "examples" / "servingpolicy-arc.yaml"
CRDS_DIR = "crds"
CLUSTER_NAME = "arc-bench"
REGISTRY = "registry.example.com"  # kwok pulls no image
# The chart installed as its README's quick start does, without the default ServingPolicy.
CHART_SETS = (
    f"operator.image.registry={REGISTRY}",
    f"router.image.registry={REGISTRY}",
    f"loadtest.image.registry={REGISTRY}",
    f"servingPolicy.image.registry={REGISTRY}",
    "servingPolicy.enabled=false",
)
API_KEY_SECRET = "qwen-arc-api-key"
# Extra kwok nodes: a kubelet's default 110 pods each, and room for every pod's requests (the
# example asks for 1 GPU, 4 CPUs and 16Gi per serving pod).
BENCH_NODE_CAPACITY = {"cpu": "1000", "memory": "8Ti", "pods": "110", "nvidia.com/gpu": "110"}
MANAGED = f"app.kubernetes.io/managed-by={mf.MANAGED_BY}"
SERVING_PODS = f"{MANAGED},app.kubernetes.io/name={mf.ENGINE_NAME}"
# The kinds watched for writes that changed something: (label, collection path under the
# namespace's API prefix).
WATCHED = (
    ("ServingPolicy", "/apis/arcserving.io/v1alpha1/namespaces/{ns}/servingpolicies"),
    ("Deployment", "/apis/apps/v1/namespaces/{ns}/deployments"),
    ("Service", "/api/v1/namespaces/{ns}/services"),
    ("ConfigMap", "/api/v1/namespaces/{ns}/configmaps"),
    ("ServiceAccount", "/api/v1/namespaces/{ns}/serviceaccounts"),
    ("NetworkPolicy", "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"),
)
CHILD_RESOURCES = frozenset(
    {
        "deployments",
        "services",
        "configmaps",
        "serviceaccounts",
        "networkpolicies",
        "roles",
        "rolebindings",
    }
)
WATCH_S = 15
# The control plane's processes whose CPU time each phase reports.
CONTROL_PLANE = (
    "kube-apiserver",
    "etcd",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok-controller",
)
MILESTONES = (
    "status observed",
    "pods ready",
    "router workers",
    "router rolled out",
    "status ready",
)


# --- the API server, as the admin ---------------------------------------------------------


class AdminApi:
    """The API server with the admin kubeconfig's client certificate (stdlib only): one kept
    connection per thread, JSON in and out, and watches on connections of their own."""

    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(kubeconfig.read_text(encoding="utf-8"))
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        server = urlsplit(cluster["server"])
        self.host, self.port = server.hostname or "127.0.0.1", server.port or 443
        self.context = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.context.load_cert_chain(user["client-certificate"], user["client-key"])
        self._local = threading.local()

    def _connection(self, timeout: float = 60) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            self.host, self.port, context=self.context, timeout=timeout
        )

    def request(self, method: str, path: str, body: Any = None, **params: str) -> tuple[int, bytes]:
        url = f"{path}?{urlencode(params)}" if params else path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):  # a kept connection the server closed: reconnect once
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._connection()
            try:
                conn.request(method, url, body=data, headers=headers)
                response = conn.getresponse()
                return response.status, response.read()
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str, **params: str) -> dict[str, Any]:
        status, payload = self.request("GET", path, **params)
        for _ in range(30):  # 429: e.g. a CRD's storage still initialising after its install
            if status != 429:
                break
            time.sleep(1)
            status, payload = self.request("GET", path, **params)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {payload[:300]!r}")
        result: dict[str, Any] = json.loads(payload)
        return result

    def items(self, path: str, **params: str) -> list[dict[str, Any]]:
        return list(self.get(path, **params).get("items") or [])

    def text(self, path: str) -> str:
        status, payload = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status}")
        return payload.decode()

    def watch(
        self,
        path: str,
        resource_version: str,
        on_event: Callable[[dict[str, Any]], None],
        stop: threading.Event,
    ) -> None:
        """Stream ``path``'s events from ``resource_version`` until ``stop`` (restarting a
        watch the server ends from the last version seen)."""
        version = resource_version
        while not stop.is_set():
            # The server ends each watch after WATCH_S, so ``stop`` is seen within that.
            conn = self._connection(timeout=WATCH_S + 30)
            params = {
                "watch": "1",
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(WATCH_S),
            }
            try:
                conn.request("GET", f"{path}?{urlencode(params)}")
                response = conn.getresponse()
                if response.status != 200:
                    raise RuntimeError(f"watch {path}: {response.status}")
                while line := response.readline():
                    event = json.loads(line)
                    if event["type"] == "ERROR":  # e.g. 410 Gone: the caller misses events
                        raise RuntimeError(f"watch {path}: {event['object']}")
                    version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        on_event(event)
            finally:
                conn.close()


def request_totals(api: AdminApi) -> Counter[tuple[str, str]]:
    """``apiserver_request_total`` summed by (verb, resource[/subresource]), every client."""
    totals: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(api.text("/metrics")):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            labels = sample.labels
            resource = labels.get("resource", "")
            if labels.get("subresource"):
                resource += "/" + labels["subresource"]
            totals[labels.get("verb", ""), resource] += sample.value
    return totals


# --- what the operator did: audit log, watches, /proc -------------------------------------


@dataclass
class AuditLog:
    """One user's requests in the API server's audit log, between two offsets; a request
    counts once (a watch when it starts, anything else when it completes)."""

    path: Path
    username: str

    def offset(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def requests(self, start: int, end: int) -> Counter[tuple[str, str, int]]:
        """(verb, resource[/subresource], HTTP code) -> count."""
        counts: Counter[tuple[str, str, int]] = Counter()
        with self.path.open("rb") as log:
            log.seek(start)
            chunk = log.read(end - start)
        for line in chunk.splitlines():
            if self.username.encode() not in line:
                continue
            event = json.loads(line)
            if event.get("user", {}).get("username") != self.username:
                continue
            verb, stage = event.get("verb", ""), event.get("stage")
            if stage != ("ResponseStarted" if verb == "watch" else "ResponseComplete"):
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", event.get("requestURI", "?"))
            if ref.get("subresource"):
                resource += "/" + ref["subresource"]
            counts[verb, resource, int((event.get("responseStatus") or {}).get("code", 0))] += 1
        return counts


@dataclass
class Writes:
    """Watch events in the namespace by (kind, event), MODIFIED split into ``MODIFIED spec``
    (metadata.generation moved: the spec changed) and ``MODIFIED other`` (status, metadata)."""

    api: AdminApi
    namespace: str
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    _generations: dict[tuple[str, str], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def start(self) -> None:
        for kind, template in WATCHED:
            path = template.format(ns=self.namespace)
            listing = self.api.get(path)
            for item in listing.get("items") or []:
                meta = item["metadata"]
                self._generations[kind, meta["name"]] = int(meta.get("generation") or 0)
            version = listing["metadata"]["resourceVersion"]
            thread = threading.Thread(
                target=self._run, args=(kind, path, version), daemon=True, name=f"watch-{kind}"
            )
            thread.start()
            self._threads.append(thread)

    def _run(self, kind: str, path: str, version: str) -> None:
        def on_event(event: dict[str, Any]) -> None:
            meta, kind_event = event["object"]["metadata"], event["type"]
            key, generation = (kind, meta["name"]), int(meta.get("generation") or 0)
            with self._lock:
                if kind_event == "MODIFIED":
                    moved = generation != self._generations.get(key)
                    kind_event = "MODIFIED spec" if moved else "MODIFIED other"
                self._generations[key] = generation
                self.counts[kind, kind_event] += 1

        try:
            self.api.watch(path, version, on_event, self._stop)
        except Exception as error:  # reported with the figures
            self.errors.append(f"{kind}: {error}")

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self.counts)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=WATCH_S + 5)


@dataclass(frozen=True)
class ProcStats:
    cpu_s: float
    rss_kib: int
    hwm_kib: int

    @classmethod
    def read(cls, pid: int) -> ProcStats:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), here after the command name.
        cpu = sum(int(v) for v in fields[11:15]) / ticks
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        return cls(cpu, int(status["VmRSS"].split()[0]), int(status["VmHWM"].split()[0]))


def control_plane(cluster: LocalCluster) -> dict[str, int]:
    """The pids of the control plane's processes by program name (kwokctl's daemons)."""
    pids = {}
    for pid in cluster.pids():
        with contextlib.suppress(OSError):
            program = Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
            if program.name in CONTROL_PLANE:
                pids[program.name] = pid
    return pids


def cpu_seconds(pids: Mapping[str, int]) -> Counter[str]:
    seconds: Counter[str] = Counter()
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            seconds[name] = ProcStats.read(pid).cpu_s
    return seconds


@dataclass(frozen=True)
class Mark:
    """Everything counted at one moment; phases are differences of two marks."""

    t: float
    audit: int
    totals: Counter[tuple[str, str]]
    writes: Counter[tuple[str, str]]
    proc: ProcStats
    control_plane: Counter[str]


# --- convergence --------------------------------------------------------------------------


def worker_urls(deployment: Mapping[str, Any]) -> list[str]:
    """The ``--worker-urls`` in a router Deployment's first container's arguments."""
    args = deployment["spec"]["template"]["spec"]["containers"][0].get("args") or []
    if "--worker-urls" not in args:
        return []
    urls = []
    for arg in args[args.index("--worker-urls") + 1 :]:
        if arg.startswith("--"):
            break
        urls.append(arg)
    return urls


def rolled_out(deployment: Mapping[str, Any] | None, replicas: int | None = None) -> bool:
    if deployment is None:
        return False
    spec, status = deployment["spec"], deployment.get("status") or {}
    want = spec.get("replicas", 1) if replicas is None else replicas
    return (
        status.get("observedGeneration") == deployment["metadata"]["generation"]
        and spec.get("replicas", 1) == want
        and status.get("replicas", 0) == want
        and status.get("updatedReplicas", 0) == want
        and status.get("readyReplicas", 0) == want
    )


def _ready(pod: Mapping[str, Any], gone: frozenset[str]) -> bool:
    status = pod.get("status") or {}
    return (
        not pod["metadata"].get("deletionTimestamp")
        and pod["metadata"]["name"] not in gone
        and bool(status.get("podIP"))
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
    )


def _condition(status: Mapping[str, Any], kind: str) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == kind:
            return str(c.get("status"))
    return None


def milestones(
    api: AdminApi, ns: str, names: Iterable[str], replicas: int, gone: frozenset[str]
) -> dict[str, int]:
    """How many of ``names`` meet each milestone now (three list calls); pods in ``gone``
    (deleted by the benchmark) count as not ready even while they still exist."""
    sps = {
        sp["metadata"]["name"]: sp
        for sp in api.items(f"/apis/arcserving.io/v1alpha1/namespaces/{ns}/servingpolicies")
    }
    deployments = {
        d["metadata"]["name"]: d
        for d in api.items(f"/apis/apps/v1/namespaces/{ns}/deployments", labelSelector=MANAGED)
    }
    ready_ips: dict[str, set[str]] = {}
    for pod in api.items(f"/api/v1/namespaces/{ns}/pods", labelSelector=SERVING_PODS):
        owner = pod["metadata"].get("labels", {}).get(mf.POLICY_LABEL)
        if owner is not None and _ready(pod, gone):
            ready_ips.setdefault(owner, set()).add(pod["status"]["podIP"])
    met: Counter[str] = Counter()
    for name in names:
        sp = sps.get(name)
        if sp is None:
            continue
        status = sp.get("status") or {}
        observed = status.get("observedGeneration") == sp["metadata"]["generation"]
        ips = ready_ips.get(name, set())
        met["status observed"] += observed
        met["pods ready"] += rolled_out(deployments.get(name), replicas) and len(ips) == replicas
        router = deployments.get(mf.router_name(name))
        wanted = sorted(f"http://{ip}:{PORT}" for ip in ips)
        workers = (
            router is not None
            and len(ips) == replicas
            and sorted(worker_urls(router)) == wanted
            and router["spec"].get("replicas", 1) >= 1
        )
        met["router workers"] += workers
        met["router rolled out"] += workers and rolled_out(router)
        met["status ready"] += (
            observed
            and status.get("readyReplicas") == replicas
            and _condition(status, "Valid") == "True"
            and _condition(status, "RouterReady") == "True"
        )
    return {m: met[m] for m in MILESTONES}


def converge(
    api: AdminApi,
    ns: str,
    names: list[str],
    replicas: int,
    *,
    start: float,
    timeout: float,
    poll: float,
    gone: frozenset[str] = frozenset(),
    wanted: tuple[str, ...] = MILESTONES,
) -> dict[str, float | None]:
    """Seconds from ``start`` until every policy first met each milestone, and ``converged``
    (every one of ``wanted`` at once); None for what the deadline passed before."""
    reached: dict[str, float | None] = dict.fromkeys((*wanted, "converged"))
    last_print = 0.0
    while True:
        now = time.monotonic()
        met = milestones(api, ns, names, replicas, gone)
        for milestone in wanted:
            if met[milestone] == len(names) and reached[milestone] is None:
                reached[milestone] = now - start
        if all(met[m] == len(names) for m in wanted):
            reached["converged"] = now - start
            return reached
        if now - last_print >= 10:
            last_print = now
            shown = ", ".join(f"{m} {c}" for m, c in met.items())
            print(f"  {now - start:6.1f} s: {shown} (of {len(names)})", flush=True)
        if now - start > timeout:
            return reached
        time.sleep(poll)


# --- set-up -------------------------------------------------------------------------------


def bench_nodes(pods: int) -> list[dict[str, Any]]:
    """kwok nodes for ``pods`` pods and half as many again (a router's rolling update adds a
    pod for a while), whatever their requests: the cluster's own three have 8 GPUs each."""
    count = math.ceil(1.5 * pods / int(BENCH_NODE_CAPACITY["pods"]))
    nodes = []
    for index in range(count):
        # Pod CIDRs after those of the cluster's own nodes.
        node = node_manifest(f"kwok-bench-{index}", len(NODE_NAMES) + index)
        node["status"]["capacity"] = dict(BENCH_NODE_CAPACITY)
        node["status"]["allocatable"] = dict(BENCH_NODE_CAPACITY)
        nodes.append(node)
    return nodes


@dataclass
class Tools:
    """kubectl and helm against the benchmark's cluster, their caches under ``--out``."""

    cluster: LocalCluster

    def env(self) -> dict[str, str]:
        return self.cluster.client_env()

    def run(self, tool: str, *args: str, input: str | None = None, timeout: float = 600) -> str:
        result = subprocess.run(
            [str(self.cluster.bin_dir / tool), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{result.stderr}")
        return result.stdout


@dataclass
class Operator:
    process: subprocess.Popen[bytes]
    log: Path
    username: str

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def start_operator(
    api: AdminApi, cluster: LocalCluster, ns: str, release: str, status_interval: float | None
) -> Operator:
    """The chart's operator Deployment's command and environment as a host process, as the
    chart's ServiceAccount (as tests/cluster's host_operator fixture)."""
    deployment = api.get(
        f"/apis/apps/v1/namespaces/{ns}/deployments/{release}-arc-serving-operator"
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    container, account = pod_spec["containers"][0], pod_spec["serviceAccountName"]
    kubeconfig = cluster.write_token_kubeconfig(
        account, ns, cluster.out.resolve() / f"operator-{ns}.kubeconfig"
    )
    args = [
        a if not a.startswith("--liveness=") else f"--liveness=http://127.0.0.1:{free_port()}/h"
        for a in container["args"]
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARC_OPERATOR_")}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    env["KUBECONFIG"] = str(kubeconfig)
    if status_interval is not None:
        env["ARC_OPERATOR_STATUS_INTERVAL"] = str(status_interval)
    log = cluster.out.resolve() / f"operator-{ns}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "arc_operator", *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    return Operator(process, log, f"system:serviceaccount:{ns}:{account}")


def servingpolicies(names: list[str], replicas: int) -> str:
    """The operator's example as ``names``, ``replicas`` pods each, one multi-document file."""
    example = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    docs = []
    for name in names:
        body = json.loads(json.dumps(example))
        body["metadata"] = {"name": name}
        body["spec"]["replicas"] = replicas
        docs.append(body)
    return yaml.safe_dump_all(docs, sort_keys=False)


# --- figures ------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    seconds: float
    operator: Counter[tuple[str, str, int]]
    totals: Counter[tuple[str, str]]
    writes: Counter[tuple[str, str]]
    cpu_s: float
    hwm_kib: int
    control_plane: Counter[str]
    times: dict[str, float | None] = field(default_factory=dict)


def phase(name: str, audit: AuditLog, before: Mark, after: Mark, **times: Any) -> Phase:
    return Phase(
        name=name,
        seconds=after.t - before.t,
        operator=audit.requests(before.audit, after.audit),
        totals=after.totals - before.totals,
        writes=after.writes - before.writes,
        cpu_s=after.proc.cpu_s - before.proc.cpu_s,
        hwm_kib=after.proc.hwm_kib,
        control_plane=after.control_plane - before.control_plane,
        times=times.get("times") or {},
    )


def by_request(counts: Counter[tuple[str, str, int]]) -> Counter[tuple[str, str]]:
    merged: Counter[tuple[str, str]] = Counter()
    for (verb, resource, _), n in counts.items():
        merged[verb, resource] += n
    return merged


def print_phase(p: Phase, policies: int) -> None:
    per_min = 60.0 / p.seconds if p.seconds > 0 else 0.0
    print(f"\n== {p.name}: {p.seconds:.1f} s")
    for milestone, seconds in p.times.items():
        shown = "not reached" if seconds is None else f"{seconds:.1f} s"
        print(f"  {milestone + ':':<22} {shown}")
    requests = by_request(p.operator)
    total = sum(requests.values())
    failed = sum(n for (_, _, code), n in p.operator.items() if code >= 400)
    applies = sum(
        n for (verb, res), n in requests.items() if verb == "patch" and res in CHILD_RESOURCES
    )
    status_patches = requests["patch", "servingpolicies/status"]
    print(
        f"  operator: {total} requests ({total / policies:.1f} per ServingPolicy, "
        f"{total * per_min:.0f}/min), {failed} answered 4xx/5xx; {applies} child applies "
        f"({applies * per_min:.0f}/min), {status_patches} status patches "
        f"({status_patches * per_min:.0f}/min); CPU {p.cpu_s:.1f} s "
        f"({100 * p.cpu_s / p.seconds:.0f}% of a core), peak RSS {p.hwm_kib / 1024:.0f} MiB"
    )
    print(f"  {'verb':<8} {'resource':<28} {'requests':>9} {'per SP':>8} {'per min':>8}")
    for (verb, res), n in sorted(requests.items(), key=lambda kv: -kv[1]):
        print(f"  {verb:<8} {res:<28} {n:>9} {n / policies:>8.2f} {n * per_min:>8.1f}")
    codes = Counter(code for (_, _, code) in p.operator.elements() if code >= 400)
    if codes:
        print(f"  operator's failed requests by code: {dict(codes)}")
    every = sum(p.totals.values())
    top = ", ".join(f"{v} {r} {n:.0f}" for (v, r), n in p.totals.most_common(6))
    print(f"  API server, every client: {every:.0f} requests; most: {top}")
    cpu = ", ".join(f"{name} {p.control_plane[name]:.1f} s" for name in CONTROL_PLANE)
    print(f"  control plane CPU: {cpu}")
    writes = {f"{kind} {event}": n for (kind, event), n in sorted(p.writes.items()) if n}
    print(f"  object events in the namespace (writes that changed something): {writes or 'none'}")


def print_summary(phases: list[Phase], policies: int, replicas: int, window: float) -> None:
    create, steady, delete = phases
    steady_min = steady.seconds / 60
    steady_req = by_request(steady.operator)
    applies = sum(
        n for (verb, res), n in steady_req.items() if verb == "patch" and res in CHILD_RESOURCES
    )
    changed = sum(
        n
        for (kind, event), n in steady.writes.items()
        if kind != "ServingPolicy" and event in ("MODIFIED spec", "ADDED", "DELETED")
    ) + sum(
        n
        for (kind, event), n in steady.writes.items()
        if kind not in ("ServingPolicy", "Deployment") and event == "MODIFIED other"
    )
    sp_changed = sum(n for (kind, _), n in steady.writes.items() if kind == "ServingPolicy")

    def t(p: Phase, key: str) -> str:
        value = p.times.get(key)
        return "not reached" if value is None else f"{value:.1f} s"

    rows = [
        ("create: every status observed", t(create, "status observed")),
        (f"create: every Deployment {replicas}/{replicas} ready", t(create, "pods ready")),
        ("create: every router lists its ready pods", t(create, "router workers")),
        ("create: ... and is rolled out", t(create, "router rolled out")),
        ("create: every status readyReplicas + RouterReady", t(create, "status ready")),
        (
            "create: operator requests per ServingPolicy",
            f"{sum(create.operator.values()) / policies:.1f}",
        ),
        ("create: operator CPU", f"{create.cpu_s:.1f} s"),
        (
            f"steady ({window:.0f} s): operator requests/min",
            f"{sum(steady_req.values()) / steady_min:.0f}",
        ),
        ("steady: child applies/min", f"{applies / steady_min:.0f}"),
        ("steady: applies that changed a child/min", f"{changed / steady_min:.1f}"),
        (
            "steady: status patches/min",
            f"{steady_req['patch', 'servingpolicies/status'] / steady_min:.0f}",
        ),
        ("steady: ServingPolicy writes that changed it/min", f"{sp_changed / steady_min:.1f}"),
        ("steady: operator CPU", f"{100 * steady.cpu_s / steady.seconds:.1f}% of a core"),
        (
            "steady: kube-apiserver CPU",
            f"{100 * steady.control_plane['kube-apiserver'] / steady.seconds:.1f}% of a core",
        ),
        ("delete: every router lists its ready pods", t(delete, "router workers")),
        ("delete: ... and is rolled out", t(delete, "router rolled out")),
        (f"delete: every Deployment {replicas}/{replicas} ready", t(delete, "pods ready")),
        ("delete: operator requests", f"{sum(delete.operator.values())}"),
        ("operator peak RSS", f"{delete.hwm_kib / 1024:.0f} MiB"),
    ]
    width = max(len(label) for label, _ in rows)
    print(f"\n== summary: {policies} ServingPolicies x {replicas} replicas")
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")


# --- the run ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.bench",
        description="The operator at a hundred ServingPolicies on the local control plane: "
        "convergence, a steady window, a share of the pods deleted (figures, no pass or fail).",
    )
    parser.add_argument("--out", type=Path, default=Path("out/cluster-bench"))
    parser.add_argument("--policies", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--window", type=float, default=300, help="seconds of the steady-state window"
    )
    parser.add_argument("--delete-fraction", type=float, default=0.2)
    parser.add_argument(
        "--status-interval",
        type=float,
        default=None,
        help="ARC_OPERATOR_STATUS_INTERVAL; default: the chart's (30 s)",
    )
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between checks")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per phase")
    parser.add_argument("--seed", type=int, default=0, help="which pods are deleted")
    parser.add_argument(
        "--keep-cluster", action="store_true", help="leave a cluster started here running"
    )
    args = parser.parse_args(argv)
    # Refused before any cluster starts.
    if args.policies < 1:
        parser.error(f"--policies must be at least 1, got {args.policies}")
    if args.replicas < 2:
        parser.error(
            f"--replicas must be at least 2 (each policy gets a router), got {args.replicas}"
        )
    if not 0 < args.delete_fraction <= 1:
        parser.error(f"--delete-fraction must be in (0, 1], got {args.delete_fraction}")
    if args.window < 0:
        parser.error(f"--window must be 0 or more seconds, got {args.window}")
    for option in ("poll", "timeout", "status_interval"):
        value = getattr(args, option)
        if value is not None and value <= 0:
            parser.error(f"--{option.replace('_', '-')} must be positive, got {value}")

    cluster = LocalCluster(out=args.out, name=CLUSTER_NAME)
    if not cluster.namespace.inside():
        # Run again inside the cluster's loopback-only network namespace: the operator's
        # scrapes of hundreds of simulated pods must never leave the machine.
        again = [sys.executable, "-m", "cluster.bench", *(sys.argv[1:] if argv is None else argv)]
        return cluster.namespace.run_inside(again, keep=args.keep_cluster)
    started = cluster.up()
    print(f"cluster {cluster.name} {'started' if started else 'reused'}: {cluster.kubeconfig}")
    tools, api = Tools(cluster), AdminApi(cluster.kubeconfig)
    pods = args.policies * (args.replicas + 1) + 20  # serving, routers, the chart's own
    nodes = bench_nodes(pods)
    if nodes:
        tools.run(
            "kubectl",
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}),
        )
        for node in nodes:
            tools.run(
                "kubectl",
                "wait",
                "--for=condition=Ready",
                f"node/{node['metadata']['name']}",
                "--timeout=120s",
            )
    ns = release = f"bench-{secrets.token_hex(3)}"
    operator: Operator | None = None
    writes: Writes | None = None
    try:
        install = ["install", release, str(CHART), "--namespace", ns, "--create-namespace"]
        for value in CHART_SETS:
            install += ["--set", value]
        tools.run("helm", *install, "--wait", "--timeout", "5m")
        tools.run(
            "kubectl",
            "create",
            "secret",
            "generic",
            API_KEY_SECRET,
            "-n",
            ns,
            "--from-literal=api-key=not-a-real-key",
        )
        operator = start_operator(api, cluster, ns, release, args.status_interval)
        interval = args.status_interval or 30.0
        print(
            f"namespace {ns}: chart installed, operator pid {operator.process.pid} "
            f"(log {operator.log}), status interval {interval:g} s; "
            f"{len(nodes)} extra kwok nodes"
        )
        writes = Writes(api, ns)
        writes.start()
        audit = AuditLog(cluster.audit_log, operator.username)
        pids = control_plane(cluster)

        def mark() -> Mark:
            assert operator is not None and writes is not None
            return Mark(
                time.monotonic(),
                audit.offset(),
                request_totals(api),
                writes.snapshot(),
                ProcStats.read(operator.process.pid),
                cpu_seconds(pids),
            )

        # Let the operator start (its watches, its empty lists) before counting.
        time.sleep(5)
        if operator.process.poll() is not None:
            raise RuntimeError(f"the operator exited; see {operator.log}")
        names = [f"sp-{i:03d}" for i in range(args.policies)]
        manifest = cluster.out.resolve() / f"servingpolicies-{ns}.yaml"
        manifest.write_text(servingpolicies(names, args.replicas))

        print(f"\ncreate: {args.policies} ServingPolicies x {args.replicas} replicas")
        before = mark()
        tools.run("kubectl", "apply", "--server-side", "-n", ns, "-f", str(manifest))
        applied_s = time.monotonic() - before.t
        reached = converge(
            api, ns, names, args.replicas, start=before.t, timeout=args.timeout, poll=args.poll
        )
        after = mark()
        phases = [
            phase("create", audit, before, after, times={"kubectl apply": applied_s, **reached})
        ]
        print_phase(phases[0], args.policies)
        router_generations = {
            d["metadata"]["name"]: d["metadata"]["generation"]
            for d in api.items(
                f"/apis/apps/v1/namespaces/{ns}/deployments",
                labelSelector=f"{mf.COMPONENT_LABEL}={mf.ROUTER_COMPONENT}",
            )
        }
        spread = Counter(router_generations.values())
        print(f"  router Deployments by metadata.generation: {dict(sorted(spread.items()))}")

        print(f"\nsteady: {args.window:g} s window")
        before = mark()
        time.sleep(args.window)
        after = mark()
        phases.append(phase("steady", audit, before, after))
        print_phase(phases[1], args.policies)

        serving = [
            p["metadata"]["name"]
            for p in api.items(f"/api/v1/namespaces/{ns}/pods", labelSelector=SERVING_PODS)
        ]
        doomed = random.Random(args.seed).sample(
            sorted(serving), round(len(serving) * args.delete_fraction)
        )
        hit = len({name.rsplit("-", 2)[0] for name in doomed})
        print(f"\ndelete: {len(doomed)} of {len(serving)} serving pods, of {hit} ServingPolicies")
        before = mark()
        with ThreadPoolExecutor(16) as pool:
            codes = list(
                pool.map(
                    lambda pod: api.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{pod}")[0],
                    doomed,
                )
            )
        deleted_s = time.monotonic() - before.t
        reached = converge(
            api,
            ns,
            names,
            args.replicas,
            start=before.t,
            timeout=args.timeout,
            poll=args.poll,
            gone=frozenset(doomed),
            wanted=("pods ready", "router workers", "router rolled out"),
        )
        after = mark()
        times = {"deletes sent": deleted_s, **reached}
        phases.append(phase("delete", audit, before, after, times=times))
        print(f"  DELETE answers: {dict(Counter(codes))}")
        print_phase(phases[2], args.policies)
        moved = Counter(
            d["metadata"]["generation"] - router_generations.get(d["metadata"]["name"], 0)
            for d in api.items(
                f"/apis/apps/v1/namespaces/{ns}/deployments",
                labelSelector=f"{mf.COMPONENT_LABEL}={mf.ROUTER_COMPONENT}",
            )
        )
        print(f"  router Deployments by generations moved: {dict(sorted(moved.items()))}")
        if writes.errors:
            print(f"  watch errors (event counts incomplete): {writes.errors}")
        log = operator.log.read_text(errors="replace").splitlines()
        print(
            f"  operator log: {len(log)} lines, "
            f"{sum(' ERROR ' in line or 'Traceback' in line for line in log)} errors, "
            f"{sum(' WARNING ' in line for line in log)} warnings"
        )
        print_summary(phases, args.policies, args.replicas, args.window)
        print(
            f"\nstatus interval {interval:g} s; machine: {os.cpu_count()} CPUs, load average "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
        )
    finally:
        if writes is not None:
            writes.stop()
        if not (started and not args.keep_cluster):
            # A reused cluster stays: take the benchmark's objects out of it.
            with contextlib.suppress(Exception):
                tools.run(
                    "kubectl", "delete", "servingpolicies", "--all", "-n", ns, "--timeout=300s"
                )
        if operator is not None:
            operator.stop()
        if started and not args.keep_cluster:
            cluster.down()
        else:
            with contextlib.suppress(Exception):
                tools.run("helm", "uninstall", release, "--namespace", ns, "--wait")
                tools.run("kubectl", "delete", "namespace", ns, "--wait=false")
    return 0


if __name__ == "__main__":
    sys.exit(main())
