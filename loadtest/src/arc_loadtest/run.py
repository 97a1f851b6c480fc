"""Run the Locust replay headless from Python (the demo and the tests use this).

``run_replay`` starts the real Locust command line on ``arc_loadtest/locustfile.py`` in a child
process (Locust monkey-patches the standard library with gevent, which must not happen in
the caller's process), waits for it with a bound, and returns the summary the locustfile
wrote. ``workers=N`` runs a master and N workers on 127.0.0.1. The API key reaches every
Locust process through its environment (``LOADTEST_API_KEY``), never its command line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arc_loadtest.replay import LOADTEST_API_KEY_ENV

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True, slots=True)
class ReplayRun:
    """The outcome of one headless run: exit code, summary (None if none was written), log."""

    exit_code: int
    summary: dict[str, Any] | None
    results: Path
    log: str


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def replay_command(
    host: str,
    trace: str | Path,
    *,
    results: str | Path,
    summary: str | Path,
    run_time_s: int,
    trace_format: str = "auto",
    block_tokens: int = 0,
    time_scale: float = 1.0,
    seed: int = 0,
    model: str = "",
    tokenizer: str | Path = "",
) -> list[str]:
    """The Locust command line of a headless replay (no master/worker options)."""
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--host", host, "--trace", str(trace), "--trace-format", trace_format,
        "--block-tokens", str(block_tokens), "--time-scale", str(time_scale),
        "--seed", str(seed), "--results", str(results), "--summary", str(summary),
        "--run-time", f"{run_time_s}s",
    ]  # fmt: skip
    if model:
        command += ["--model", model]
    if tokenizer:
        command += ["--tokenizer", str(tokenizer)]
    return command


def run_replay(
    host: str,
    trace: str | Path,
    *,
    out_dir: str | Path | None = None,
    run_time_s: int = 600,
    workers: int = 0,
    api_key: str | None = None,
    **options: Any,
) -> ReplayRun:
    """Replay ``trace`` against ``host`` headless; returns exit code, summary and log.

    ``options`` are ``replay_command``'s keywords (trace_format, block_tokens, time_scale,
    seed, model, tokenizer). The child gets ``run_time_s`` plus a grace period to finish.
    ``api_key`` (None: send none, whatever the caller's environment holds) goes to the
    children in ``LOADTEST_API_KEY``.
    """
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="replay-"))
    out.mkdir(parents=True, exist_ok=True)
    results, summary = out / "results.jsonl", out / "summary.json"
    summary.unlink(missing_ok=True)
    command = replay_command(
        host, trace, results=results, summary=summary, run_time_s=run_time_s, **options
    )
    env = {name: value for name, value in os.environ.items() if name != LOADTEST_API_KEY_ENV}
    env |= {"PYTHONUNBUFFERED": "1"} | ({LOADTEST_API_KEY_ENV: api_key} if api_key else {})
    grace = 60
    if workers < 1:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=run_time_s + grace, env=env
        )
        code, log = done.returncode, done.stdout + done.stderr
    else:
        port = str(_free_port())
        master = subprocess.Popen(
            [*command, "--master", "--master-bind-host", "127.0.0.1",
             "--master-bind-port", port, "--expect-workers", str(workers),
             "--expect-workers-max-wait", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        helpers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "locust",
                    "-f",
                    str(LOCUSTFILE),
                    "--worker",
                    "--master-host",
                    "127.0.0.1",
                    "--master-port",
                    port,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for _ in range(workers)
        ]
        try:
            master_log, _ = master.communicate(timeout=run_time_s + grace)
            logs = [master_log]
            for helper in helpers:
                logs.append(helper.communicate(timeout=grace)[0])
        finally:
            for process in [master, *helpers]:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        code, log = master.returncode, "\n".join(logs)
    data = json.loads(summary.read_text()) if summary.exists() else None
    return ReplayRun(exit_code=code, summary=data, results=results, log=log)
