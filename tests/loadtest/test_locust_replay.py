"""The real Locust replaying small traces against the real vLLM (CPU build), tiny model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import conversation_records, write_lines

from arc_harness.vllm_server import VllmServer
from arc_loadtest.replay import SUMMARY_LOG_PREFIX, ServerClient
from arc_loadtest.report import CacheCounters, parse_counters
from arc_loadtest.run import ReplayRun, run_replay
from arc_loadtest.tokens import vocabulary_from_server, vocabulary_from_tokenizer
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow]

BLOCK_TOKENS = 32  # vLLM's CPU block size must be a multiple of 32


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("loadtest-vllm") / "vllm.log"
    with VllmServer(model_dir, block_size=BLOCK_TOKENS, num_gpu_blocks=64, log_path=log) as srv:
        yield srv


def replay(server: VllmServer, trace: Path, **options: Any) -> ReplayRun:
    """``run_replay`` of ``trace`` in BLOCK_TOKENS-token blocks against ``server``, with its
    API key and, unless given, a run-time derived from the trace."""
    if "run_time_s" not in options:
        options["run_time_s"] = replay_run_time_s(
            trace, time_scale=options.get("time_scale", 1.0), block_tokens=BLOCK_TOKENS
        )
    return run_replay(server.base_url, trace, api_key=server.api_key, block_tokens=BLOCK_TOKENS,
                      **options)  # fmt: skip


def counters(server: VllmServer) -> CacheCounters:
    response = requests.get(server.base_url + "/metrics", timeout=30)
    response.raise_for_status()
    return parse_counters(response.text)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replay_answers_every_request_as_the_trace_says(
    server: VllmServer, model_dir: Path, tmp_path: Path
) -> None:
    records = conversation_records(sessions=3, turns=3, block_tokens=BLOCK_TOKENS)
    trace = write_lines(tmp_path / "conversation.jsonl", records)
    before = counters(server)
    run = replay(server, trace, out_dir=tmp_path / "out", time_scale=0.5, tokenizer=model_dir)
    after = counters(server)
    assert run.exit_code == 0, run.log[-3000:]
    rows = {r["index"]: r for r in read_rows(run.results)}
    assert sorted(rows) == list(range(len(records)))
    for index, record in enumerate(records):
        row = rows[index]
        assert row["ok"], row["error"]
        assert row["input_tokens"] == row["prompt_tokens"] == record["input_length"]
        assert row["output_tokens"] == record["output_length"]
        assert row["ttft_s"] is not None and 0 < row["ttft_s"] <= row["e2e_s"]
        # One gap per token after the first; tokens that arrive with the first have none.
        assert len(row["itl_s"]) <= record["output_length"] - 1
    # The hit rate is the server's: its counters moved by exactly what the summary reports.
    cache = run.summary["prefix_cache"]
    assert cache["hit_tokens"] == after.hits - before.hits
    assert cache["query_tokens"] == after.queries - before.queries
    assert cache["hit_rate"] == pytest.approx(cache["hit_tokens"] / cache["query_tokens"])
    assert cache["hit_tokens"] > 0  # sessions share a system prompt and their history
    assert run.summary["requests_ok"] == len(records)
    assert run.summary["itl_s"]["count"] > 0
    # The same summary as one JSON log line, for runs whose files nobody can fetch (a Job).
    (logged,) = [line for line in run.log.splitlines() if SUMMARY_LOG_PREFIX in line]
    assert json.loads(logged.split(SUMMARY_LOG_PREFIX, 1)[1]) == run.summary
    # Three conversations: each holds a third of the requests, which a session-keyed router
    # would put on one replica; the log says so, naming the trace.
    assert f"{trace}: session chat:1 holds 3 of the trace's 9 requests (33%)" in run.log


def test_each_stream_is_read_to_its_end_and_its_connection_reused(
    server: VllmServer, model_dir: Path, tmp_path: Path
) -> None:
    """uvicorn's access log names each request's client port: the replay's connections carry
    several requests each. A client that closed its connection after [DONE], before the body's
    end, would open one per request, and a proxy in front would drop its own connection to the
    server each time."""
    records = conversation_records(sessions=2, turns=4, block_tokens=BLOCK_TOKENS)
    trace = write_lines(tmp_path / "conversation.jsonl", records)
    assert server.log_path is not None
    start = server.log_path.stat().st_size
    run = replay(server, trace, out_dir=tmp_path / "out", time_scale=0.5, tokenizer=model_dir)
    assert run.exit_code == 0, run.log[-3000:]
    log = server.log_path.read_bytes()[start:].decode(errors="replace")
    ports = re.findall(r'127\.0\.0\.1:(\d+) - "POST /v1/completions HTTP/1\.1" 200', log)
    assert len(ports) == len(records), log[-3000:]
    assert len(set(ports)) < len(records), ports


def test_session_turns_are_sent_after_the_previous_answer(
    server: VllmServer, model_dir: Path, tmp_path: Path
) -> None:
    # Turns 0.01 s apart in the trace: far less than an answer takes, so turns are held.
    records = conversation_records(sessions=2, turns=3, spacing_s=0.01)
    trace = write_lines(tmp_path / "fast.jsonl", records)
    run = replay(server, trace, out_dir=tmp_path / "out", tokenizer=model_dir)
    assert run.exit_code == 0, run.log[-3000:]
    rows = {r["index"]: r for r in read_rows(run.results)}
    chat_to_index = {record["chat_id"]: i for i, record in enumerate(records)}
    for index, record in enumerate(records):
        if record["parent_chat_id"] == -1:
            continue
        parent = rows[chat_to_index[record["parent_chat_id"]]]
        assert rows[index]["sent_wall"] >= parent["sent_wall"] + parent["e2e_s"]
        assert rows[index]["held_s"] > 0


def test_master_and_two_workers_replay_each_request_once(
    server: VllmServer, model_dir: Path, tmp_path: Path
) -> None:
    records = conversation_records(sessions=4, turns=2, block_tokens=BLOCK_TOKENS)
    trace = write_lines(tmp_path / "conversation.jsonl", records)
    run = replay(server, trace, out_dir=tmp_path / "out", time_scale=0.5, workers=2)
    assert run.exit_code == 0, run.log[-3000:]
    rows = read_rows(run.results)
    assert sorted(r["index"] for r in rows) == list(range(len(records)))
    assert {r["part"] for r in rows} == {0, 1}
    assert all(r["ok"] and r["ttft_s"] is not None for r in rows)
    # Both workers derived the same token mapping from the master's vocabulary.
    mappings = {line.split("token mapping ")[1].split()[0]
                for line in run.log.splitlines() if "token mapping " in line}  # fmt: skip
    assert len(mappings) == 1


def test_malformed_trace_stops_the_run_before_any_request(
    server: VllmServer, tmp_path: Path
) -> None:
    records = conversation_records(sessions=1, turns=2, block_tokens=BLOCK_TOKENS)
    lines = [json.dumps(r) for r in records]
    lines[1] = lines[1].replace('"input_length"', '"input_len"')
    trace = tmp_path / "broken.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    before = counters(server)
    # Malformed: no run-time can be derived from it; the replay stops before any request.
    run = replay(server, trace, out_dir=tmp_path / "out", run_time_s=60)
    assert run.exit_code == 2
    assert f"{trace}:2: missing field 'input_length'" in run.log
    assert run.summary is None and not run.results.exists()
    assert counters(server) == before


def test_server_vocabulary_matches_the_tokenizer_size(server: VllmServer, model_dir: Path) -> None:
    client = ServerClient(server.base_url, api_key=server.api_key or "")
    try:
        from_server = vocabulary_from_server(client, client.served_model())
        bos = client.post_json("/tokenize", {"prompt": "a", "add_special_tokens": True})[1]
    finally:
        client.close()
    exact = vocabulary_from_tokenizer(model_dir)
    assert max(from_server.allowed) == max(exact.allowed)
    assert bos["tokens"][0] in from_server.special
    assert set(exact.allowed) <= set(from_server.allowed)


def test_a_failed_request_makes_the_exit_code_non_zero(
    server: VllmServer, model_dir: Path, tmp_path: Path
) -> None:
    # The second prompt (70 blocks of 32 tokens) exceeds the server's 2016-token window.
    records = [
        {"timestamp": 0, "input_length": 64, "output_length": 2, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 2240, "output_length": 2, "hash_ids": list(range(70))},
    ]
    trace = write_lines(tmp_path / "too_long.jsonl", records)
    run = replay(server, trace, out_dir=tmp_path / "out", time_scale=0.01, tokenizer=model_dir)
    assert run.exit_code == 1, run.log[-3000:]
    rows = {r["index"]: r for r in read_rows(run.results)}
    assert rows[0]["ok"] and not rows[1]["ok"]
    assert "HTTP 400" in rows[1]["error"]
    assert run.summary["requests_failed"] == 1
