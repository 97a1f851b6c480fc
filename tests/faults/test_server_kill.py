"""Kill the real vLLM server (SIGKILL to its process group) in the middle of a Locust replay.

The load test must count the failures, say why it stopped, and exit non-zero soon after the
kill, not at the end of the trace (two minutes of trace are left when the server dies).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from arc_harness.vllm_server import VllmServer
from arc_loadtest.run import ReplayRun, run_replay
from tests.faults.serving import BLOCK_TOKENS, docqa_trace, metric_sum
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow]

# The trace runs 120 s; the kill comes after a handful of answers (about 5 s in). From the
# kill the load test needs 10 unanswered requests (5 s of trace) and its summary to exit: it
# must exit before the trace's end, which is 110 s of trace later.
TRACE_REQUESTS, SPACING_S = 240, 0.5
ANSWERS_BEFORE_KILL = 5
MAX_UNREACHABLE = 10


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("kill-vllm") / "vllm.log"
    with VllmServer(model_dir, block_size=BLOCK_TOKENS, num_gpu_blocks=64, log_path=log) as srv:
        yield srv


def kill_process_group(server: VllmServer) -> None:
    """SIGKILL the server's whole process group (API server, engine core), as an OOM kill
    or a node loss does: no shutdown, no goodbye to open connections."""
    process = server._proc  # VllmServer has no public kill: this is for tests only
    assert process is not None, "the server is not running"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_killed_server_fails_the_replay_promptly(
    server: VllmServer, model_dir: Path, tmp_path: Path
) -> None:
    trace = docqa_trace(tmp_path / "trace.jsonl", count=TRACE_REQUESTS, spacing_s=SPACING_S)
    outcome: list[ReplayRun] = []

    def replay_trace() -> None:
        outcome.append(
            run_replay(server.base_url, trace, out_dir=tmp_path / "out", run_time_s=run_time_s,
                       api_key=server.api_key, block_tokens=BLOCK_TOKENS, tokenizer=model_dir)
        )  # fmt: skip

    run_time_s = replay_run_time_s(trace, block_tokens=BLOCK_TOKENS)
    replay = threading.Thread(target=replay_trace, daemon=True)
    replay.start()
    deadline = time.monotonic() + run_time_s
    while metric_sum(server, "vllm:request_success_total") < ANSWERS_BEFORE_KILL:
        assert replay.is_alive() and time.monotonic() < deadline, "the replay never got going"
        time.sleep(0.2)
    kill_process_group(server)
    killed = time.time()

    # A load test that missed the kill would run to the trace's end: wait that long, and a
    # minute for its summary.
    replay.join(timeout=TRACE_REQUESTS * SPACING_S + 60)
    exited = time.time() - killed
    assert not replay.is_alive(), f"the load test still runs {exited:.0f} s after the kill"
    (run,) = outcome
    # Promptly: before the trace's last request was due. Its first request went out no
    # earlier than it was due, so the trace ends no earlier than this.
    rows = [json.loads(line) for line in run.results.read_text().splitlines()]
    trace_end = min(row["sent_wall"] for row in rows) + (TRACE_REQUESTS - 1) * SPACING_S
    assert killed + exited < trace_end, (
        f"exit {exited:.1f} s after the kill, {killed + exited - trace_end:.1f} s after the "
        "trace's end"
    )
    assert run.exit_code == 1, run.log[-3000:]
    summary = run.summary
    assert summary is not None, run.log[-3000:]
    assert summary["requests_ok"] >= ANSWERS_BEFORE_KILL
    assert summary["requests_failed"] >= MAX_UNREACHABLE
    assert summary["requests_unsent"] > 0  # the rest of the trace was not sent into the void
    assert (
        summary["requests_ok"] + summary["requests_failed"] + summary["requests_unsent"]
        == TRACE_REQUESTS
    )
    assert f"did not answer {MAX_UNREACHABLE} requests in a row" in summary["stopped_early"]
    assert "replay stopped early" in run.log
    print(
        f"kill: {summary['requests_ok']} ok, {summary['requests_failed']} failed, "
        f"{summary['requests_unsent']} unsent of {TRACE_REQUESTS}; exit {exited:.1f} s after"
    )
