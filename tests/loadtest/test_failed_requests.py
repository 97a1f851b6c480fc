"""How the real Locust replay reports failed requests: refused (nothing listens) or in flight
(the real vLLM server is killed while it streams the answers)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import write_lines

from arc_harness.fleet import FleetServer, parse_metrics
from arc_loadtest.run import ReplayRun, run_replay

pytestmark = [pytest.mark.locust, pytest.mark.slow]

BLOCK_TOKENS = 32
# Below the kernel's ephemeral range (32768 and up), where an outgoing connection could take
# the port; nothing else of the test suite listens in 27800-27819.
SERVER_PORT = 27800
SILENT_PORT = 27810  # never bound: connections to it are refused


def long_answers(path: Path, requests: int, output_tokens: int, spacing_s: float) -> Path:
    """Mooncake records with distinct two-block prompts and long answers."""
    records = [
        {"timestamp": round(1000 * spacing_s * n), "input_length": 2 * BLOCK_TOKENS,
         "output_length": output_tokens, "hash_ids": [2 * n, 2 * n + 1]}
        for n in range(requests)
    ]  # fmt: skip
    return write_lines(path, records)


def read_rows(run: ReplayRun) -> list[dict]:
    return [json.loads(line) for line in run.results.read_text().splitlines()]


def running_and_finished(server: FleetServer) -> tuple[float, float]:
    """vLLM's requests running now and finished so far (``vllm:num_requests_running``,
    ``vllm:request_success_total``); (0, 0) when the server does not answer."""
    request = urllib.request.Request(server.url + "/metrics", headers=server.auth_headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # nosec B310: local
            samples = parse_metrics(response.read().decode())
    except OSError:
        return 0.0, 0.0
    running, finished = (
        sum(value for _, value in samples.get(name, []))
        for name in ("vllm:num_requests_running", "vllm:request_success_total")
    )
    return running, finished


def test_requests_to_a_closed_port_fail_as_refused(model_dir: Path, tmp_path: Path) -> None:
    trace = long_answers(tmp_path / "t.jsonl", requests=3, output_tokens=4, spacing_s=0.1)
    run = run_replay(f"http://127.0.0.1:{SILENT_PORT}", trace, out_dir=tmp_path / "out",
                     run_time_s=60, block_tokens=BLOCK_TOKENS, model="m",
                     tokenizer=model_dir)  # fmt: skip
    assert run.exit_code == 1, run.log[-2000:]
    assert run.summary is not None
    assert run.summary["requests_failed"] == 3
    assert run.summary["failures"]["refused"] == 3
    assert run.summary["requests_failed_in_flight"] == 0
    assert "failed requests: 3 refused" in run.log


# Tries of the kill: on a loaded machine all six answers may end before a scrape sees one
# running with two unfinished (the streams hold back the server's frontend, /metrics included).
KILL_TRIES = 3


def replay_killed_mid_stream(model_dir: Path, work_dir: Path) -> ReplayRun | None:
    """Six long answers due 0.1 s apart, into a cache that holds all six (49 blocks each), the
    server killed while it reports a request running and two unfinished; the replay's run, or
    None when every answer ended before that was seen. A machine that decodes the tiny model
    fast runs them one after another: a stream whose bytes are always ready holds back the
    server's frontend and the replay's next send until it ends, so two may never run at once."""
    work_dir.mkdir(parents=True, exist_ok=True)
    server = FleetServer(0, model_dir, port=SERVER_PORT, api_key="key-for-this-test",
                         capacity_blocks=320, max_model_len=2048, policy="lru",
                         work_dir=work_dir)  # fmt: skip
    requests = 6
    trace = long_answers(work_dir / "t.jsonl", requests, output_tokens=1500, spacing_s=0.1)
    outcome: list[ReplayRun] = []
    with server:
        replay = threading.Thread(
            target=lambda: outcome.append(
                run_replay(server.url, trace, out_dir=work_dir / "out", run_time_s=240,
                           block_tokens=BLOCK_TOKENS, model=server.served_model_name,
                           tokenizer=model_dir, api_key=server.api_key)
            )
        )  # fmt: skip
        replay.start()
        deadline = time.monotonic() + 120
        # Kill while the server itself reports a request running and two unfinished, so that
        # one is still unfinished when the kill lands after the scrape (a loaded machine's
        # scrapes lag: waiting for an answer to complete instead let the streams open at the
        # time end too, and the kill then cut none).
        while (seen := running_and_finished(server))[0] < 1 or seen[1] > requests - 2:
            if seen[1] == requests or time.monotonic() > deadline:
                replay.join(timeout=300)
                return None
            time.sleep(0.2)
        server.kill()
        replay.join(timeout=300)
    assert outcome, "the replay did not end within 300 s"
    return outcome[0]


@pytest.mark.vllm
def test_requests_cut_by_a_killed_server_fail_in_flight(model_dir: Path, tmp_path: Path) -> None:
    for attempt in range(KILL_TRIES):
        killed = replay_killed_mid_stream(model_dir, tmp_path / f"try-{attempt}")
        if killed is not None:
            break
    assert killed is not None, f"in {KILL_TRIES} tries no request ran with two unfinished"
    run = killed
    assert run.exit_code == 1 and run.summary is not None, run.log[-2000:]
    rows = read_rows(run)
    failed = [row for row in rows if not row["ok"]]
    assert failed, "the kill failed no request"
    # A request whose stream had started (HTTP 200) was in flight; none counts as refused.
    assert all(row["failure"] == "in_flight" for row in failed if row["status"] == 200)
    assert run.summary["requests_failed_in_flight"] >= 1
    assert run.summary["requests_failed_in_flight"] == sum(
        row["failure"] == "in_flight" for row in failed
    )
