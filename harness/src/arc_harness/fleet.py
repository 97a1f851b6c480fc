"""A local fleet: N real vLLM CPU servers with the arc_evictor plugin behind the real vLLM router.

The fleet is what a ServingPolicy with ``spec.replicas > 1`` runs in a cluster
(docs/architecture.md, "Routing"), on 127.0.0.1 with fixed ports:

- server ``i`` (``FleetServer``, an ``arc_harness.vllm_server.VllmServer``) serves HTTP on
  ``port_base + 10 * i``, publishes vLLM's KV-cache events over ZMQ on ``+ 1`` (topic ``""``,
  the router subscribes to every topic) and serves their replay on ``+ 2``; it runs the plugin
  with its own policy file (``ARC_EVICTOR_CONFIG``), block size ``BLOCK_TOKENS`` and a cache
  of ``capacity_blocks`` blocks, its engine bound to a core of its own while the machine has
  enough (``engine_core``), and ``--enable-scale-out`` as the operator's serving pods run
  (the router renders text prompts through it; token-id prompts, which the load test sends,
  reach kv_aware's index without it: ``vllm_router_kv_routing_inputs_total{result="token_ids"}``);
- the router (``FleetRouter``, the ``vllm-router`` console script next to this Python) listens on
  ``port_base + 90`` and exports Prometheus metrics on ``port_base + 91``, with ``--policy P``
  and static ``--worker-urls``; for ``kv_aware`` also ``--kv-event-source URL=tcp://…``,
  ``--kv-event-replay-source``, ``--kv-event-block-size BLOCK_TOKENS`` and
  ``--kv-event-model NAME``.

Every server of a fleet shares one API key (as the pods of one ServingPolicy share a secret);
the router gets it with ``--api-key`` and clients send ``auth_headers``.

Contract (fault tests rely on it; it does not change without changing them):

- ``Fleet(model_dir, ...)`` is a context manager; entering starts every server (until each
  answers ``/health``), then the router (until it answers ``/health``; at start-up the router
  itself waits for its workers to be healthy); leaving stops the router and every server, also
  after a failure.
- ``fleet.servers``: list of ``FleetServer`` in index order, each with ``index``, ``url``
  (``base_url``), ``kv_event_port``, ``kv_replay_port``, ``policy_file``, ``start()``,
  ``stop()`` (SIGTERM to its process group), ``kill()`` (SIGKILL, no clean shutdown),
  ``running`` and ``healthy()``. Stopping or killing a server leaves the router running
  (it notices through its health checks); ``start()`` brings it back on the same ports.
- ``fleet.router``: ``FleetRouter`` with ``url``, ``metrics_url``, ``policy``, ``start()``,
  ``stop()``, ``kill()``, ``restart(policy=None)`` (stop, then start with the same workers and
  ``policy`` if given) and ``metrics()`` (the parsed ``/metrics`` page).
- ``fleet.reset_caches()``: every running server's prefix cache emptied (vLLM's
  ``POST /reset_prefix_cache``, which also clears the plugin's policy state).
- ``fleet.switch_policy(name)``: every running server's eviction policy switched live through
  its policy file; returns when each engine reports ``name``.
- ``fleet.per_replica_stats()``: one ``ReplicaStats`` per server (``None`` fields for a
  server that is down): vLLM's prefix-cache token counters and request count, the plugin's
  block counters and active policy. Differences of two readings give one run's figures.
- ``fleet.complete(prompt, ...)``: one completion through the router (token ids), returning
  the parsed JSON answer; raises ``FleetError`` on a non-200 answer.
- ``fleet.ports()``: every port the fleet listens on; ``start()`` (of the fleet or of the
  router alone) raises ``FleetError`` naming a port something else already listens on.

The default ``port_base`` lies below Linux's range for outgoing connections (32768-60999), so
no other process's connection can hold one of the fixed ports.

Invariants: only ports ``port_base .. port_base + 99`` are used, all on 127.0.0.1; at most
``replicas`` vLLM servers of a fleet run at once; every child process is in its own process
group and is stopped by ``close()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from arc_harness.vllm_server import VllmServer, write_policy_file
from arc_serving_common.names import CONFIG_ENV, POLICY_NAMES, POLL_MS_ENV

BLOCK_TOKENS = 32  # vLLM's CPU build needs a multiple of 32; the router gets the same
ROUTER_POLICIES = (
    "round_robin",
    "random",
    "consistent_hash",
    "power_of_two",
    "cache_aware",
    "kv_aware",
    "sticky_least_loaded",
)
ROUTER_BINARY = Path(sys.executable).with_name("vllm-router")
SERVED_MODEL = "arc-fleet"
PORTS_PER_SERVER = 10
ROUTER_PORT_OFFSET = 90
MAX_REPLICAS = ROUTER_PORT_OFFSET // PORTS_PER_SERVER
POLL_MS = 100  # how often the plugin reads its policy file
SWITCH_TIMEOUT_S = 60.0
RESET_TIMEOUT_S = 30.0
ROUTER_TIMEOUT_S = 60.0
SERVER_NICE = 5  # below the load generator, as in the demos


# A parsed Prometheus page: sample name -> [(labels, value), ...].
Samples = dict[str, list[tuple[dict[str, str], float]]]


class FleetError(RuntimeError):
    """A fleet component did not start, answer or switch; the message says which and why."""


def http_request(
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> tuple[int, bytes]:
    """GET (or POST ``body`` as JSON); returns status and body, HTTP errors included.
    Raises ``OSError`` (``urllib.error.URLError``) when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"} | (headers or {}),
    )
    try:
        # Every URL here is a server of this machine's own (the fleet's http://127.0.0.1:PORT,
        # a local cluster's pod), never user input.
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # nosec B310
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def parse_metrics(text: str) -> Samples:
    """A Prometheus text page as {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def _total(samples: Samples, name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One reading of one server's counters (all None when the server did not answer).

    ``query_tokens``/``hit_tokens``: vLLM's ``vllm:prefix_cache_{queries,hits}_total``;
    ``requests``: ``vllm:request_success_total`` summed over finish reasons;
    ``block_queries``/``block_hits``: the plugin's ``arc_evictor_block_{queries,hits}_total``;
    ``policy``: the plugin's active policy (``arc_evictor_policy_info``).
    """

    index: int
    url: str
    query_tokens: float | None = None
    hit_tokens: float | None = None
    requests: float | None = None
    block_queries: float | None = None
    block_hits: float | None = None
    policy: str | None = None

    @property
    def up(self) -> bool:
        return self.requests is not None


def replica_stats(url: str, index: int = 0, headers: dict[str, str] | None = None) -> ReplicaStats:
    """The counters of the vLLM server at ``url`` now; all-None fields when it does not
    answer."""
    try:
        status, body = http_request(url + "/metrics", headers=headers, timeout_s=10)
    except OSError:
        return ReplicaStats(index, url)
    if status != 200:
        return ReplicaStats(index, url)
    samples = parse_metrics(body.decode())
    active = [
        labels.get("policy")
        for labels, value in samples.get("arc_evictor_policy_info", [])
        if value == 1
    ]
    return ReplicaStats(
        index,
        url,
        query_tokens=_total(samples, "vllm:prefix_cache_queries_total"),
        hit_tokens=_total(samples, "vllm:prefix_cache_hits_total"),
        requests=_total(samples, "vllm:request_success_total"),
        block_queries=_total(samples, "arc_evictor_block_queries_total"),
        block_hits=_total(samples, "arc_evictor_block_hits_total"),
        policy=active[0] if active else None,
    )


def reset_prefix_cache(
    url: str, headers: dict[str, str] | None = None, timeout_s: float = RESET_TIMEOUT_S
) -> None:
    """Empty the prefix cache (and the plugin's policy state) of the vLLM server at ``url``
    (``POST /reset_prefix_cache``, served in dev mode); raises ``FleetError`` when it still
    refuses after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = http_request(url + "/reset_prefix_cache", {}, headers)
        # vLLM refuses while blocks are held (a request still finishing): retry.
        if status == 200 and json.loads(body or b"{}").get("success", True):
            return
        if time.monotonic() > deadline:
            raise FleetError(
                f"{url} refused to reset its prefix cache for {timeout_s:.0f}s "
                f"(HTTP {status}: {body[:200]!r})"
            )
        time.sleep(0.5)


class FleetServer(VllmServer):
    """One replica: a ``VllmServer`` on fixed ports with KV events and the plugin.

    Invariants: ``port``, ``kv_event_port`` and ``kv_replay_port`` never change, so the router's
    static worker list and event sources stay valid across ``stop()``/``start()``; the policy
    file exists from construction on.
    """

    def __init__(
        self,
        index: int,
        model_dir: Path,
        *,
        port: int,
        api_key: str,
        capacity_blocks: int,
        max_model_len: int,
        policy: str,
        work_dir: Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.index = index
        self.fixed_port = port
        self.kv_event_port = port + 1
        self.kv_replay_port = port + 2
        self.policy_file = work_dir / f"policy-{index}.json"
        write_policy_file(self.policy_file, policy)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds the publisher only for an endpoint with "*" or "::" in it and connects
            # to any other; ZeroMQ without IPv6 binds this IPv4-mapped address as 127.0.0.1.
            "endpoint": f"tcp://[::ffff:127.0.0.1]:{self.kv_event_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.kv_replay_port}",
            "topic": "",
        }
        super().__init__(
            model_dir,
            block_size=BLOCK_TOKENS,
            num_gpu_blocks=capacity_blocks + 1,  # + vLLM's null block
            max_model_len=max_model_len,
            served_model_name=SERVED_MODEL,
            env={
                CONFIG_ENV: str(self.policy_file.resolve()),
                POLL_MS_ENV: str(POLL_MS),
                "VLLM_SERVER_DEV_MODE": "1",  # serves POST /reset_prefix_cache
                "VLLM_CPU_OMP_THREADS_BIND": str(engine_core(index)),
            },
            extra_args=[
                "--kv-events-config",
                json.dumps(events),
                "--enable-scale-out",
                *extra_args,
            ],
            log_path=work_dir / f"server-{index}.log",
            api_key=api_key,
            model_in_engine_process=False,  # a worker process vLLM binds to the core above
        )
        self.url = local_url(port)

    def command(self) -> list[str]:
        # VllmServer.start() draws a free port before it builds the command; the fleet's
        # ports are fixed (the router's worker list names them), so they replace it here.
        self.port = self.fixed_port
        self.base_url = self.url
        return ["nice", "-n", str(SERVER_NICE), *super().command()]

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (no clean shutdown), then reap it."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self.stop()

    def stats(self) -> ReplicaStats:
        """The counters now; a server that does not answer gives all-None fields."""
        return replica_stats(self.url, self.index, self.auth_headers)


def local_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def server_port(port_base: int, index: int) -> int:
    """The HTTP port of server ``index`` of a fleet on ``port_base``."""
    return port_base + PORTS_PER_SERVER * index


def server_url(port_base: int, index: int) -> str:
    """The URL of server ``index`` of a fleet on ``port_base``: the router's worker URL."""
    return local_url(server_port(port_base, index))


def engine_core(index: int) -> int:
    """The CPU that server ``index``'s engine is bound to: one each while there are enough.

    vLLM's automatic binding puts every CPU server's engine on the first core, so two local
    replicas would share one core and serve half of what each alone measures, where replicas
    in a cluster each have their own CPUs.
    """
    cores = sorted(os.sched_getaffinity(0))
    return cores[index % len(cores)]


class FleetRouter:
    """The real ``vllm-router`` in front of the fleet's servers, in its own process group.

    Invariants: ``url`` and ``metrics_url`` never change; ``policy`` is the policy of the
    running router (or of the next ``start()``); the API key reaches it as ``--api-key`` (the
    router has no environment variable for it; in a cluster Kubernetes expands it from the
    secret, docs/architecture.md).
    """

    def __init__(
        self,
        servers: Sequence[FleetServer],
        *,
        port: int,
        policy: str,
        api_key: str,
        log_path: Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        check_router_policy(policy)
        self.servers = list(servers)
        self.port = port
        self.metrics_port = port + 1
        self.url = local_url(port)
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.policy = policy
        self.api_key = api_key
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The router's command line for the current policy."""
        workers = [server.url for server in self.servers]
        cmd = [
            str(ROUTER_BINARY),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            "--policy",
            self.policy,
            "--worker-urls",
            *workers,
            # One token: a key that starts with "-" (token_urlsafe draws them) would otherwise
            # read as an option.
            f"--api-key={self.api_key}",
        ]
        if self.policy == "kv_aware":
            for server in self.servers:
                cmd += [
                    "--kv-event-source",
                    f"{server.url}=tcp://127.0.0.1:{server.kv_event_port}",
                    "--kv-event-replay-source",
                    f"{server.url}=tcp://127.0.0.1:{server.kv_replay_port}",
                ]
            cmd += ["--kv-event-block-size", str(BLOCK_TOKENS), "--kv-event-model", SERVED_MODEL]
        return cmd + self.extra_args

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = ROUTER_TIMEOUT_S) -> FleetRouter:
        """Spawn the router and wait until ``/health`` answers 200; raise with the log tail."""
        if self._proc is not None:
            raise RuntimeError("FleetRouter already started")
        if not ROUTER_BINARY.is_file():
            raise FleetError(f"no router at {ROUTER_BINARY}: install arc-serving-harness")
        # Else another process on the port would answer /health in this router's place.
        check_ports_free([self.port, self.metrics_port])
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise FleetError(
                    f"the router exited with code {code}; log {self.log_path}:\n"
                    f"{_tail(self.log_path)}"
                )
            if self.healthy():
                return self
            time.sleep(0.3)
        self.stop()
        raise FleetError(
            f"the router was not healthy within {timeout_s:.0f}s; log "
            f"{self.log_path}:\n{_tail(self.log_path)}"
        )

    def healthy(self) -> bool:
        try:
            return http_request(self.url + "/health", timeout_s=2)[0] == 200
        except (urllib.error.URLError, OSError):
            return False

    def _signal_stop(self, sig: signal.Signals, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        self._signal_stop(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL (no clean shutdown)."""
        self._signal_stop(signal.SIGKILL, 15.0)

    def restart(
        self, policy: str | None = None, extra_args: Sequence[str] | None = None
    ) -> FleetRouter:
        """Stop the router and start it again (same workers), with ``policy`` and
        ``extra_args`` in place of the current ones where given."""
        if policy is not None:
            check_router_policy(policy)
        self.stop()
        if policy is not None:
            self.policy = policy
        if extra_args is not None:
            self.extra_args = list(extra_args)
        return self.start()

    def metrics(self) -> Samples:
        """The router's Prometheus page, parsed (see ``parse_metrics``)."""
        status, body = http_request(self.metrics_url, timeout_s=10)
        if status != 200:
            raise FleetError(f"{self.metrics_url} answered HTTP {status}")
        return parse_metrics(body.decode())


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def check_ports_free(ports: Sequence[int]) -> None:
    """Raise FleetError naming the first of ``ports`` that something on 127.0.0.1 holds."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As servers bind: connections of an earlier process in TIME_WAIT do not count.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                raise FleetError(
                    f"port {port} on 127.0.0.1 is in use ({exc}): stop what holds it or give "
                    "the fleet another port_base"
                ) from exc


def check_router_policy(policy: str) -> None:
    if policy not in ROUTER_POLICIES:
        raise ValueError(
            f"unknown routing policy {policy!r}; valid policies: {', '.join(ROUTER_POLICIES)}"
        )


class Fleet:
    """``replicas`` servers and one router; ``with Fleet(model_dir, work_dir=...) as fleet:``.

    See the module docstring for the contract. ``capacity_blocks`` is per server (what one
    pod's KV cache holds); ``policy`` is the routing policy, ``eviction`` the plugin's policy.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        work_dir: str | Path,
        replicas: int = 2,
        policy: str = "kv_aware",
        eviction: str = "lru",
        capacity_blocks: int = 64,
        max_model_len: int | None = None,
        port_base: int = 27400,
        api_key: str | None = None,
        server_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
    ) -> None:
        if not 1 <= replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be between 1 and {MAX_REPLICAS}, got {replicas}")
        check_router_policy(policy)
        if eviction not in POLICY_NAMES:
            raise ValueError(
                f"unknown eviction policy {eviction!r}; valid policies: {', '.join(POLICY_NAMES)}"
            )
        if not 1024 <= port_base <= 65535 - 100:
            raise ValueError(f"port_base must be between 1024 and 65435, got {port_base}")
        if capacity_blocks < 2:
            raise ValueError(f"capacity_blocks must be at least 2, got {capacity_blocks}")
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.eviction = eviction
        length = max_model_len or min(2048, capacity_blocks * BLOCK_TOKENS)
        self.servers = [
            FleetServer(
                index,
                Path(model_dir),
                port=server_port(port_base, index),
                api_key=self.api_key,
                capacity_blocks=capacity_blocks,
                max_model_len=length,
                policy=eviction,
                work_dir=self.work_dir,
                extra_args=server_args,
            )
            for index in range(replicas)
        ]
        self.router = FleetRouter(
            self.servers,
            port=port_base + ROUTER_PORT_OFFSET,
            policy=policy,
            api_key=self.api_key,
            log_path=self.work_dir / "router.log",
            extra_args=router_args,
        )

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers a client request to the router (or a server) must carry."""
        return {"Authorization": f"Bearer {self.api_key}"}

    # -- life cycle ---------------------------------------------------------------------

    def ports(self) -> list[int]:
        """Every port the fleet listens on."""
        ports = [self.router.port, self.router.metrics_port]
        for server in self.servers:
            ports += [server.fixed_port, server.kv_event_port, server.kv_replay_port]
        return ports

    def start(self) -> Fleet:
        """Start every server at once (start-up waits on I/O as much as on CPU), then the
        router; on any failure stop everything and raise the first error. A port already in
        use fails at once, naming it, instead of as a server that never comes up."""
        check_ports_free(self.ports())
        try:
            with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
                for started in [pool.submit(server.start) for server in self.servers]:
                    started.result()
            self.router.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the router, then every server (each even if another one fails to stop)."""
        with contextlib.ExitStack() as stack:
            for server in self.servers:
                stack.callback(server.stop)
            stack.callback(self.router.stop)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- operations ---------------------------------------------------------------------

    def complete(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        *,
        session: str | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """One completion of ``prompt`` (token ids) through the router (or ``url``)."""
        headers = self.auth_headers | ({"X-Session-ID": session} if session else {})
        status, body = http_request(
            (url or self.router.url) + "/v1/completions",
            {
                "model": SERVED_MODEL,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "min_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
            },
            headers,
        )
        if status != 200:
            raise FleetError(
                f"completion through {url or self.router.url} answered HTTP "
                f"{status}: {body[:300]!r}"
            )
        return json.loads(body)

    def per_replica_stats(self) -> list[ReplicaStats]:
        return [server.stats() for server in self.servers]

    def reset_caches(self) -> None:
        """Empty every running server's prefix cache (and its policy's state)."""
        for server in self.servers:
            if server.running:
                reset_prefix_cache(server.url, server.auth_headers)

    def switch_policy(self, name: str) -> None:
        """Switch every running server's eviction policy live; wait until each reports it."""
        if name not in POLICY_NAMES:
            raise ValueError(
                f"unknown eviction policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}"
            )
        for server in self.servers:
            write_policy_file(server.policy_file, name)
        self.eviction = name
        for server in self.servers:
            if not server.running:
                continue
            deadline = time.monotonic() + SWITCH_TIMEOUT_S
            # The plugin reads the file between scheduler steps: a request makes steps happen.
            while server.stats().policy != name:
                if time.monotonic() > deadline:
                    raise FleetError(
                        f"server {server.index} did not switch to {name!r} within "
                        f"{SWITCH_TIMEOUT_S:.0f}s"
                    )
                self.complete(range(4, 20), url=server.url)
                time.sleep(POLL_MS / 1000)
