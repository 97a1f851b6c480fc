"""vLLM's offline engine (vllm.LLM) with and without the plugin, as make demo-batch runs it:
real vLLM (CPU build), one small set, no mocks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from arc_dev import demo_batch
from arc_dev.demo import STOCK, StepClock
from arc_serving_common.traces import load_trace
from arc_simulator.generate import docqa, write_generated

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# 4 documents of ~128 tokens, 12 prompts: each run takes a few seconds.
SMALL_SET = replace(demo_batch.BATCH_SET, documents=4, document_tokens=128)
CAPACITY = 40  # MAX_MODEL_LEN's 32 blocks fit; the set's 12 prompts need a few evictions


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch")


@pytest.fixture(scope="module")
def trace(folder: Path) -> Path:
    path = folder / "set.jsonl"
    write_generated(path, docqa(SMALL_SET), "bailian", demo_batch.BLOCK_TOKENS)
    return path


def settings(folder: Path) -> demo_batch.BatchSettings:
    return demo_batch.BatchSettings(out=folder, capacity_blocks=CAPACITY, trace=SMALL_SET)


def engine(folder: Path, model_dir: Path, trace: Path, size: int, policies: list[str]
           ) -> dict[str, Any]:  # fmt: skip
    return demo_batch.run_engine(settings(folder), model_dir, trace, size, policies, StepClock())


@pytest.fixture(scope="module")
def engines(folder: Path, model_dir: Path, trace: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """Per (batch size, policy): the run of one plugin engine and one stock engine each."""
    runs = {}
    for size in (1, 16):
        for policies in (["lru", "arc", "trio"], [STOCK]):
            for run in engine(folder, model_dir, trace, size, policies)["runs"]:
                runs[size, run["policy"]] = run
    return runs


@pytest.mark.parametrize("size", [1, 16])
@pytest.mark.parametrize("policy", ["lru", "arc", "trio", STOCK])
def test_every_policy_answers_every_prompt_in_full(
    engines: dict[tuple[int, str], dict[str, Any]], trace: Path, size: int, policy: str
) -> None:
    requests = load_trace(trace, block_tokens=demo_batch.BLOCK_TOKENS)
    run = engines[size, policy]
    assert run["requests"] == len(requests)
    assert run["output_tokens"] == sum(request.output_length for request in requests)
    assert all(0 < ttft <= e2e for ttft, e2e in zip(run["ttft_s"], run["e2e_s"], strict=True))


@pytest.mark.parametrize("size", [1, 16])
@pytest.mark.parametrize("policy", ["lru", "arc", "trio"])
def test_the_plugin_counters_move(
    engines: dict[tuple[int, str], dict[str, Any]], size: int, policy: str
) -> None:
    run = engines[size, policy]
    assert run["block_queries"] > 0
    assert 0 < run["block_hits"] <= run["block_queries"]
    # vLLM's own count of the same hits, when no request was preempted and re-queried.
    if run["preemptions"] == 0:
        assert run["block_hits"] * demo_batch.BLOCK_TOKENS == run["cached_tokens"]


@pytest.mark.parametrize("size", [1, 16])
def test_stock_equals_lru_in_hit_rate(
    engines: dict[tuple[int, str], dict[str, Any]], size: int
) -> None:
    stock, lru = engines[size, STOCK], engines[size, "lru"]
    assert stock["block_queries"] == lru["block_queries"]
    assert stock["block_hits"] == lru["block_hits"]


def test_a_bad_policy_stops_the_engine_start_with_the_plugins_message(
    folder: Path, model_dir: Path, trace: Path
) -> None:
    bad = folder / "bad"
    bad.mkdir()
    with pytest.raises(demo_batch.BatchDemoError, match="valid policies: lru"):
        demo_batch.run_engine(settings(bad), model_dir, trace, 1, ["fifo"], StepClock())
