"""make demo-batch without vLLM: its arguments and its batch model of the simulator."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from arc_dev import demo_batch
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.generate import docqa, write_generated
from arc_simulator.simulate import simulate


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "lru,fifo"], "unknown policy 'fifo'"),
        (["--policies", "arc,trio"], "--policies needs 'lru'"),
        (["--batch-sizes", "1,x"], "--batch-sizes takes comma-separated integers"),
        (["--batch-sizes", "0,4"], "--batch-sizes needs distinct integers >= 1"),
        (["--capacity", "8"], "--capacity must be at least 32 blocks"),
        (["--seed", "-1"], "--seed must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        demo_batch.parse_args(args)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def docqa_set(folder: Path) -> list[TraceRequest]:
    path = folder / "set.jsonl"
    write_generated(path, docqa(demo_batch.BATCH_SET), "bailian", demo_batch.BLOCK_TOKENS)
    return load_trace(path, block_tokens=demo_batch.BLOCK_TOKENS)


@pytest.mark.parametrize("policy", ["lru", "arc", "trio"])
def test_a_batch_of_one_is_the_sequential_mode_on_one_block_less(
    policy: str, tmp_path: Path
) -> None:
    requests = docqa_set(tmp_path)
    sequential = simulate(requests, policy, demo_batch.CAPACITY_BLOCKS - 1)
    batch = demo_batch.predict_batch(requests, policy, demo_batch.CAPACITY_BLOCKS, 1)
    assert batch == pytest.approx(sequential.block_hit_rate)


def test_a_larger_batch_pins_more_and_hits_less(tmp_path: Path) -> None:
    requests = docqa_set(tmp_path)
    rates = [demo_batch.predict_batch(requests, "lru", demo_batch.CAPACITY_BLOCKS, size)
             for size in (1, 16, 64)]  # fmt: skip
    assert rates[0] > rates[1] > rates[2]


def test_batch_replica_never_runs_more_than_max_num_seqs(tmp_path: Path) -> None:
    requests = [replace(r, timestamp_s=0.0) for r in docqa_set(tmp_path)]
    policy = demo_batch.build_policy("lru", 10_000, requests)
    replica = demo_batch.BatchReplica.of(policy, "overlapping", demo_batch.COST)
    replica.max_num_seqs = 4
    most = 0
    for position, request in enumerate(requests):
        replica.enqueue(position, request)
        replica.advance(0.0)
        most = max(most, len(replica.running))
    assert most == 4
