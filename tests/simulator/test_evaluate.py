"""The evaluation on small generated traces: outputs, arithmetic, bad input, the online bound."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from arc_serving_common.traces import load_trace
from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.cli import main
from arc_simulator.evaluate import (
    EvaluationConfig,
    EvaluationRow,
    check_targets,
    make_row,
    run_evaluation,
)
from arc_simulator.generate import ConversationParams, DocQAParams
from arc_simulator.simulate import SimulationResult, simulate

SMALL = EvaluationConfig(
    sample_trace=None,
    seeds=(0, 1),
    capacity_percents=(5.0, 10.0, 20.0),
    docqa=DocQAParams(documents=40, document_tokens=800, questions_per_document=5.0),
    conversation=ConversationParams(sessions=40),
)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[EvaluationRow]]:
    out = tmp_path_factory.mktemp("evaluate")
    return out, run_evaluation(SMALL, out)


def result(policy: str, hits: int, queries: int = 100) -> SimulationResult:
    return SimulationResult(policy, 10, "sequential", block_queries=queries, block_hits=hits)


def test_writes_a_plot_per_trace_and_mode_and_three_tables(evaluated) -> None:
    out, rows = evaluated
    traces = ["docqa-seed0", "conversation-seed0", "docqa-seed1", "conversation-seed1"]
    for trace in traces:
        for mode in ("sequential", "overlapping"):
            assert (out / f"{trace}-{mode}.png").stat().st_size > 10_000
        assert (out / "traces" / f"{trace}.jsonl").exists()
    assert len(rows) == len(traces) * 2 * 3
    assert json.loads((out / "evaluate.json").read_text())[0]["trace"] == rows[0].trace
    with (out / "evaluate.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    text = (out / "evaluate.txt").read_text()
    assert "gap closed" in text and "belady" in text


def test_rows_hold_the_simulators_hit_rates(evaluated) -> None:
    out, rows = evaluated
    row = next(r for r in rows if r.trace == "docqa-seed1" and r.mode == "sequential")
    requests = load_trace(out / "traces" / "docqa-seed1.jsonl")
    for policy in ("lru", "arc", "trio", "belady"):
        direct = simulate(requests, policy, row.capacity, sequential=True)
        assert row.hit_rates[policy] == direct.block_hit_rate
    assert row.best_of_lru_arc == max(row.hit_rates["lru"], row.hit_rates["arc"])
    assert row.hit_rates["belady"] >= max(row.hit_rates.values()) - 1e-12


def test_margin_and_gap_closed_arithmetic() -> None:
    results = [result("lru", 30), result("arc", 40), result("trio", 45), result("belady", 60)]
    row = make_row("t", "sequential", 5.0, results, "trio", small_capacity=True)
    assert row.best_of_lru_arc == pytest.approx(0.40)
    assert row.margin == pytest.approx(0.05)
    assert row.gap_closed == pytest.approx(0.25)
    assert row.meets_margin and row.meets_gap


def test_a_row_below_max_lru_arc_misses_both_targets() -> None:
    results = [result("lru", 50), result("arc", 40), result("trio", 49), result("belady", 60)]
    row = make_row("t", "overlapping", 5.0, results, "trio", small_capacity=True)
    assert not row.meets_margin and not row.meets_gap
    assert check_targets([row]) == [
        "t overlapping 5%: trio is 1.00 points below max(LRU, ARC)",
        "t overlapping 5%: trio closes -10.0% of the gap to Belady (target 25%)",
    ]


def test_no_gap_to_belady_and_an_empty_trace_give_no_share() -> None:
    results = [result("lru", 0, 0), result("arc", 0, 0), result("trio", 0, 0)]
    row = make_row("empty", "sequential", 5.0, [*results, result("belady", 0, 0)], "trio", True)
    assert row.gap_closed is None and row.margin == 0.0
    assert check_targets([row]) == []


def test_gap_target_applies_only_at_the_two_smallest_capacities(evaluated) -> None:
    _, rows = evaluated
    small = {r.capacity_percent for r in rows if r.small_capacity}
    assert small == {5.0, 10.0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"modes": ("parallel",)}, "unknown mode 'parallel'"),
        ({"policies": ("arc", "belady", "trio")}, "needs policy 'lru'"),
        ({"capacity_percents": (0.0,)}, r"capacity percents must be in \(0, 100\]"),
        ({"candidate": "mru"}, "unknown eviction policy 'mru'"),
    ],
)
def test_bad_config_is_rejected_with_a_message(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvaluationConfig(**overrides)


def test_cli_rejects_bad_seeds_before_any_work(tmp_path: Path, capsys) -> None:
    assert main(["evaluate", "--out", str(tmp_path / "x"), "--seeds", "zero"]) == 2
    assert "--seeds 'zero'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_default_sample_is_the_packaged_mooncake_trace(tmp_path: Path) -> None:
    config = EvaluationConfig(seeds=(), capacity_percents=(5.0,), modes=("sequential",))
    rows = run_evaluation(config, tmp_path)
    assert MOONCAKE_SAMPLE.is_file()
    assert [row.trace for row in rows] == ["mooncake_synthetic"]
    assert rows[0].hit_rates["belady"] > rows[0].best_of_lru_arc > 0.1


def test_conversation_rows_carry_the_online_bound_and_no_other_rows_do(evaluated) -> None:
    _, rows = evaluated
    for row in rows:
        if row.trace.startswith("conversation"):
            # Told which blocks are the prompts, LRU can only gain on plain LRU.
            assert row.online_bound is not None
            assert row.hit_rates["lru"] <= row.online_bound <= row.hit_rates["belady"]
        else:
            assert row.online_bound is None and row.online_bound_gap_closed is None


def test_a_gap_miss_beyond_the_online_bound_says_so() -> None:
    results = [result("lru", 40), result("arc", 40), result("belady", 80), result("trio", 41)]
    row = make_row("conversation-seed0", "sequential", 5.0, results, "trio", True)
    row.online_bound = 0.45  # closes 12.5% of the 40-point gap
    (miss,) = check_targets([row])
    assert "closes 2.5% of the gap" in miss
    assert "beyond any online policy: prompt-pinning LRU closes 12.5%" in miss
    row.online_bound = 0.60  # an online policy could close half: a plain miss
    (miss,) = check_targets([row])
    assert "beyond" not in miss
