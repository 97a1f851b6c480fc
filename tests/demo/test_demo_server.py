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
from arc_dev.tinymodel import build_tiny_llama
from arc_dev.vllm_server import VllmServer
from arc_serving_common.traces import load_trace
from arc_simulator.simulate import simulate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPACITY = 64  # blocks: no eviction for the short trace below


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("demo-model"))


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


def test_timing_the_server_sees_cached_prompts_faster_and_decode_steps_cost_time(
    session: demo.ServerSession,
) -> None:
    session.prepare("lru")
    calibration = measure_cost(session.complete, 12 * demo.BLOCK_TOKENS)
    assert calibration.miss_s > calibration.hit_s > 0
    assert calibration.decode_s > 0
    cost = calibration.cost_model()
    assert cost.prefill_seconds_per_token > 0
    assert cost.step_seconds == calibration.hit_s


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
    # Far enough apart, on this machine's own timing, that the replay is sequential.
    calibration = measure_cost(session.complete, 200)
    gap_s = 4 * (calibration.miss_s + 3 * calibration.decode_s) + 0.2
    for number, record in enumerate(records):
        record["timestamp"] = round(gap_s * number, 3)
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, records)
    requests = load_trace(trace, block_tokens=demo.BLOCK_TOKENS)
    expected = simulate(requests, "arc", CAPACITY, sequential=True)
    run = demo.replay_policy(session, "arc", trace, tmp_path, tokenizer=model_dir,
                             time_scale=1.0, run_time_s=int(6 * gap_s) + 300,
                             total=len(requests), scheduled_s=6 * gap_s,
                             clock=demo.StepClock())  # fmt: skip
    assert run.requests == len(requests) == 6
    rows = [json.loads(line) for line in (tmp_path / "arc" / "results.jsonl").open()]
    ends = sorted((r["sent_wall"], r["sent_wall"] + r["e2e_s"]) for r in rows)
    assert all(end <= next_sent for (_, end), (next_sent, _) in itertools.pairwise(ends))
    assert run.block_queries == expected.block_queries
    assert run.block_hits == expected.block_hits > 0
    assert (tmp_path / "arc" / "locust.log").is_file()
