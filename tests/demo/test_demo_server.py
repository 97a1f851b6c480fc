"""The demo's server steps against the real vLLM (CPU build) with the plugin: the live
switch plus cache reset that gives every policy an empty cache, and one short replay whose
block counts must be the simulator's. One small server for the module (about a minute)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from arc_dev import demo
from arc_dev.pacing import measure_cost
from arc_harness.vllm_server import VllmServer
from arc_serving_common.traces import load_trace
from arc_simulator.simulate import simulate
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPACITY = 64  # blocks: no eviction for the short trace below


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    folder = tmp_path_factory.mktemp("demo-server")
    srv = demo.demo_server(model_dir, CAPACITY, folder / "policy.json", "lru", folder / "vllm.log")
    with srv:
        yield srv


@pytest.fixture
def session(server: VllmServer) -> demo.ServerSession:
    policy_file = Path(server.extra_env["ARC_EVICTOR_CONFIG"])
    return demo.ServerSession(
        server.base_url, server.served_model_name, policy_file, server.api_key
    )


PROMPT = [5 + i % 900 for i in range(4 * demo.BLOCK_TOKENS + 5)]  # 4 full blocks + 5 tokens


def test_timing_the_server_runs_real_uncached_and_cached_prompts(
    session: demo.ServerSession,
) -> None:
    session.prepare("lru")
    before = session.counters()
    blocks = 12
    calibration = measure_cost(session.complete, blocks * demo.BLOCK_TOKENS, rounds=3)
    after = session.counters()
    # 3 warm-up prompts and 3 timed ones, each sent uncached, then cached, then cached with
    # more output tokens.
    assert after.requests_finished - before.requests_finished == 2 * 9
    # vLLM computes a prompt's last token, so a cached 12-block prompt hits 11 blocks; the
    # timed prompts share no block with the warm-up's, so they were timed uncached first.
    assert after.block_hits - before.block_hits == 2 * 2 * 3 * (blocks - 1)
    cost = calibration.cost_model()  # valid whatever the timings (CostModel checks its fields)
    assert min(calibration.miss_s, calibration.hit_s, cost.step_seconds) > 0
    assert cost.prefill_seconds_per_token > 0 and cost.decode_seconds_per_token > 0


def hits_of(session: demo.ServerSession, prompt: list[int]) -> float:
    before = session.counters().block_hits
    session.complete(prompt)
    return session.counters().block_hits - before


def test_prepare_switches_policy_and_empties_the_cache(session: demo.ServerSession) -> None:
    session.prepare("lru")
    session.complete(PROMPT)
    assert hits_of(session, PROMPT) == 4  # all four full blocks were cached
    session.prepare("arc")
    assert session.counters().active_policy == "arc"
    assert json.loads(session.policy_file.read_text()) == {"policy": "arc"}
    assert hits_of(session, PROMPT) == 0  # the reset emptied the cache
    assert hits_of(session, PROMPT) == 4


def test_replay_counts_the_blocks_the_simulator_counts(
    session: demo.ServerSession, model_dir: Path, tmp_path: Path
) -> None:
    from arc_serving_common.traces import write_trace
    from arc_simulator.generate import DocQAParams, docqa, to_records

    params = DocQAParams(documents=3, document_tokens=200, questions_per_document=2,
                         question_tokens=20, output_tokens=3, seed=1)  # fmt: skip
    records = list(to_records(docqa(params), "bailian", demo.BLOCK_TOKENS))
    for number, record in enumerate(records):
        # Each question waits for the one before (the replay gates a turn on its parent's
        # answer), so the replay is sequential on any machine, as the simulator's mode is.
        record["timestamp"] = 0.1 * number
        record["parent_chat_id"] = records[number - 1]["chat_id"] if number else -1
        record["turn"] = number + 1
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, records)
    requests = load_trace(trace, block_tokens=demo.BLOCK_TOKENS)
    expected = simulate(requests, "arc", CAPACITY, sequential=True)
    run_time_s = replay_run_time_s(trace, block_tokens=demo.BLOCK_TOKENS)
    run = demo.replay_policy(session, "arc", trace, tmp_path, tokenizer=model_dir,
                             time_scale=1.0, run_time_s=run_time_s, total=len(requests),
                             scheduled_s=1.0, clock=demo.StepClock())  # fmt: skip
    assert run.requests == len(requests) == 6
    rows = [
        json.loads(line) for line in (tmp_path / "arc" / "results.jsonl").read_text().splitlines()
    ]
    spans = sorted((row["sent_wall"], row["sent_wall"] + row["e2e_s"]) for row in rows)
    assert all(end <= sent for (_, end), (sent, _) in itertools.pairwise(spans))
    assert run.block_queries == expected.block_queries
    assert run.block_hits == expected.block_hits > 0
    assert (tmp_path / "arc" / "locust.log").is_file()
