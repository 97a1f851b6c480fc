"""The load test's stop rule for a vanished server: its option, how the summary shows it, and
the rule against a gateway whose backend is gone (a real local HTTP server answering what an
ingress answers then: 502, 503, 504). The rule against a killed real vLLM server runs in
test_server_kill."""

from __future__ import annotations

import http.server
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from arc_loadtest.replay import ReplaySettings
from arc_loadtest.report import format_summary, summarize
from arc_loadtest.run import run_replay
from tests.replay_budget import replay_run_time_s

GATEWAY_TRACE_REQUESTS = 60


def test_negative_max_unreachable_is_refused_by_name() -> None:
    settings = ReplaySettings(host="http://127.0.0.1:1", trace="t.jsonl", max_unreachable=-1)
    with pytest.raises(ValueError, match=r"--max-unreachable must be >= 0 .*got -1"):
        settings.validate()


def test_zero_max_unreachable_is_accepted_as_never() -> None:
    ReplaySettings(host="http://127.0.0.1:1", trace="t.jsonl", max_unreachable=0).validate()


def test_summary_says_why_the_replay_stopped_early() -> None:
    reason = "the server did not answer 10 requests in a row (connection refused or lost)"
    summary = summarize([], planned=5, start=None, end=None, duration_s=1.0, stop_reason=reason)
    assert summary["stopped_early"] == reason and summary["requests_unsent"] == 5
    assert f"replay stopped early: {reason}" in format_summary(summary)
    assert summarize([], planned=0, start=None, end=None, duration_s=1.0)["stopped_early"] is None


class _DeadBackendGateway(http.server.BaseHTTPRequestHandler):
    """What an ingress answers when its backend is gone: fast 502, 503 and 504, in turn."""

    statuses = itertools.cycle((502, 503, 504))

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = b"<html><body>Bad Gateway</body></html>"
        self.send_response(next(self.statuses))
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: pytest captures stderr."""


@pytest.fixture
def gateway() -> Iterator[str]:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DeadBackendGateway) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()


@pytest.mark.locust
def test_gateway_errors_stop_the_replay_early_like_a_lost_connection(
    gateway: str, tmp_path: Path
) -> None:
    # Model and tokenizer given: nothing is asked of the server before the replay.
    tokenizer = {"model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(50)}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 50 * i, "input_length": 16, "output_length": 2, "hash_ids": [i]})
        + "\n" for i in range(GATEWAY_TRACE_REQUESTS)
    ))  # fmt: skip
    run = run_replay(gateway, trace, out_dir=tmp_path / "out", block_tokens=16,
                     run_time_s=replay_run_time_s(trace, block_tokens=16),
                     model="m", tokenizer=tmp_path)  # fmt: skip
    assert run.exit_code == 1, run.log[-3000:]
    summary = run.summary
    assert summary is not None, run.log[-3000:]
    assert "HTTP 502/503/504" in summary["stopped_early"]
    rows = [json.loads(line) for line in run.results.read_text().splitlines()]
    assert {row["status"] for row in rows} <= {502, 503, 504}
    # Ten in a row stop it (the default --max-unreachable): far from the 60 of the trace.
    assert 10 <= summary["requests_sent"] < GATEWAY_TRACE_REQUESTS / 2, summary
    assert summary["requests_unsent"] == GATEWAY_TRACE_REQUESTS - summary["requests_sent"]
    assert "unsent or abandoned in flight" in run.log
