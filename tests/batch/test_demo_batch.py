"""make demo-batch without vLLM: its arguments and its batch model of the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def test_a_batch_of_one_under_lru_is_the_sequential_mode_on_one_block_less(
    tmp_path: Path,
) -> None:
    requests = docqa_set(tmp_path)
    sequential = simulate(requests, "lru", demo_batch.CAPACITY_BLOCKS - 1)
    batch = demo_batch.predict_batch(requests, "lru", demo_batch.CAPACITY_BLOCKS, 1)
    assert batch == pytest.approx(sequential.block_hit_rate)


def test_a_larger_batch_pins_more_and_hits_less(tmp_path: Path) -> None:
    requests = docqa_set(tmp_path)
    rates = [demo_batch.predict_batch(requests, "lru", demo_batch.CAPACITY_BLOCKS, size)
             for size in (1, 16, 64)]  # fmt: skip
    assert rates[0] > rates[1] > rates[2]


def test_batch_replica_never_runs_more_than_max_num_seqs(tmp_path: Path) -> None:
    requests = [demo_batch.with_unhashed_block(r) for r in docqa_set(tmp_path)]
    policy = demo_batch.build_policy("lru", 10_000, requests)
    replica = demo_batch.BatchReplica.of(policy, "overlapping", demo_batch.STEPS)
    replica.max_num_seqs = 4
    most = 0
    for position, request in enumerate(requests):
        replica.enqueue(position, request)
        replica.advance(0.0)
        most = max(most, len(replica.running))
    assert most == 4


def test_a_finished_requests_unhashed_block_leaves_the_pool(tmp_path: Path) -> None:
    requests = [demo_batch.with_unhashed_block(r) for r in docqa_set(tmp_path)[:20]]
    policy = demo_batch.build_policy("arc", 10_000, requests)
    replica = demo_batch.BatchReplica.of(policy, "overlapping", demo_batch.STEPS)
    replica.max_num_seqs = 4
    for position, request in enumerate(requests):
        replica.enqueue(position, request)
    replica.advance(float("inf"))
    assert not any(replica.pool.is_cached(request.keys[-1]) for request in requests)
    assert all(replica.pool.is_cached(request.keys[0]) for request in requests)


def run_of(policy: str, size: int, hits: float, ttft_s: float, cpu_s: float) -> dict[str, Any]:
    """An engine's run as ``arc_dev.batch_engine`` writes it."""
    return {"policy": policy, "max_num_seqs": size, "block_queries": 100.0, "block_hits": hits,
            "ttft_s": [ttft_s] * 3, "e2e_s": [ttft_s + 0.1] * 3, "wall_s": 10.0, "cpu_s": cpu_s,
            "output_tokens": 50, "preemptions": 0, "load_average": 1.0}  # fmt: skip


def test_gains_are_against_lru_at_the_same_batch_size(tmp_path: Path) -> None:
    cells = [
        demo_batch.cell_of(run_of("lru", 4, 50, 2.0, 20.0), 0.5),
        demo_batch.cell_of(run_of("arc", 4, 55, 1.8, 18.0), 0.56),
        demo_batch.cell_of(run_of(demo_batch.STOCK, 4, 50, 2.2, 21.0), 0.5),
        demo_batch.cell_of(run_of("lru", 16, 40, 1.0, 10.0), 0.4),
        demo_batch.cell_of(run_of("arc", 16, 40, 1.0, 10.0), 0.4),
    ]
    gains = demo_batch.batch_gains(cells)
    assert [(g.policy, g.max_num_seqs) for g in gains] == [("arc", 4), ("arc", 16)]
    assert gains[0].hit_points == pytest.approx(5.0)
    assert gains[0].hit_relative == pytest.approx(0.1)
    assert gains[0].ttft_reduction == pytest.approx(0.1)
    assert gains[0].cpu_reduction == pytest.approx(0.1)
    assert gains[0].predicted_points == pytest.approx(6.0)
    assert gains[1].hit_points == 0
    assert "MISSED" not in demo_batch.prediction_lines(cells)[0]
    assert demo_batch.plot_gains(gains, tmp_path / "gains.png", "title").stat().st_size > 0
