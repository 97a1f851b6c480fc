"""The scaling study as a user runs it: narrowed, its outputs, and its bad input."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from arc_serving_common.traces import load_trace
from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.cli import main
from arc_simulator.fleet import simulate_fleet
from arc_simulator.scaling import overload_warnings, per_replica_capacity
from arc_simulator.simulate import CostModel, simulate, time_scaled
from tests.simulator.builders import mooncake

# Powers of two, so every figure below is exact in binary floating point.
COST = CostModel(
    prefill_seconds_per_token=2**-10,  # 1,024 tokens per second
    decode_seconds_per_token=0.125,
    step_seconds=0.25,
)
COST_OPTIONS = (
    *("--prefill-tokens-per-second", "1024", "--decode-seconds-per-token", "0.125"),
    *("--step-seconds", "0.25"),
)


@pytest.fixture
def three_requests(write_lines) -> Path:
    """Arrivals at 0, 4 and 8 s (span 8 s) of 2, 3 and 1 blocks of 512 tokens, 4 output
    tokens each; the second repeats the first's 2 blocks.

    On one replica with a cache of 8 blocks the prefill lane works 0.25 + 1,024 / 1,024 =
    1.25 s, then 0.25 + 512 / 1,024 = 0.75 s (2 blocks hit; the last block is computed),
    then 0.75 s: 2.75 s. Decode takes 4 x 0.125 = 0.5 s. Pinned: 2 blocks for 1.75 s, 3 for
    1.25 s, 1 for 1.25 s, 8.5 block-seconds.
    """
    return write_lines(
        [mooncake(0, [1, 2]), mooncake(4_000, [1, 2, 3]), mooncake(8_000, [4])], "three.jsonl"
    )


@pytest.fixture
def steady(write_lines) -> Path:
    """40 requests 1 s apart (span 39 s), 1 block each, none shared: 4 arrive in each tenth
    of the span, and each takes the prefill lane 0.25 + 512 / 1,024 = 0.75 s. One replica:
    utilisation 40 x 0.75 / 39 = 0.769, peak 4 x 0.75 / 3.9 = 0.769."""
    return write_lines([mooncake(1_000 * k, [k]) for k in range(40)], "steady.jsonl")


def test_a_narrowed_study_writes_its_table_csv_json_and_plot(tmp_path: Path, capsys) -> None:
    out = tmp_path / "scale"
    code = main(
        [
            *("scale", "--out", str(out), "--trace", "mooncake", "--replicas", "1,2"),
            *("--router", "round_robin,kv_aware", "--policy", "lru,arc", "--sequential"),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "lru hit" in printed and "arc hit" in printed and "sequential mode" in printed
    rows = json.loads((out / "scale.json").read_text())
    # (1 replica shared by 2 routers + 2 replicas x 2 routers) x 2 cache sizes x 2 policies
    assert len(rows) == (2 + 2) * 2 * 2
    one = [row for row in rows if row["replicas"] == 1 and row["policy"] == "lru"]
    assert {row["router"] for row in one} == {"round_robin", "kv_aware"}
    assert len({row["block_hit_rate"] for row in one}) == 1
    with (out / "scale.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    assert (out / "scale-mooncake.png").stat().st_size > 0
    assert "mooncake" in (out / "scale.txt").read_text()


def test_session_affinity_reaches_the_study_and_its_rows(tmp_path: Path) -> None:
    def rows(*extra: str) -> list[dict]:
        out = tmp_path / f"scale{len(extra)}"
        args = ("scale", "--out", str(out), "--trace", "mooncake", "--replicas", "4")
        assert main([*args, "--router", "kv_aware", "--policy", "lru", *extra]) == 0
        return json.loads((out / "scale.json").read_text())

    plain, sticky = rows(), rows("--session-affinity-ttl", "60")
    assert {row["affinity_ttl_s"] for row in plain} == {None}
    assert {row["affinity_ttl_s"] for row in sticky} == {60}
    assert [row["block_hit_rate"] for row in plain] != [row["block_hit_rate"] for row in sticky]


def test_fixed_total_cache_is_split_over_replicas() -> None:
    assert per_replica_capacity(1000, 10, "per-replica", 4) == 100
    assert per_replica_capacity(1000, 10, "total", 4) == 25
    assert per_replica_capacity(10, 1, "total", 32) == 1


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--router", "nearest"], "unknown router 'nearest'"),
        (["--replicas", "1,0"], "replicas must be between 1"),
        (["--replicas", "two"], "--replicas 'two'"),
        (["--trace", "wiki"], "unknown trace 'wiki'"),
        (["--cache", "shared"], "unknown cache size 'shared'"),
        (["--policy", "belady"], "belady"),
        (["--policy", "fifo"], "unknown eviction policy 'fifo'"),
        (["--capacity", "0"], "capacity must be a percent"),
        (["--router-temperature", "-1"], "--router-temperature must be a finite number >= 0"),
        (["--session-affinity-ttl", "0"], "the session affinity TTL must be whole seconds"),
    ],
)
def test_bad_study_input_exits_2_before_any_work(args, problem, tmp_path: Path) -> None:
    out = tmp_path / "never"
    done = subprocess.run(
        [sys.executable, "-m", "arc_simulator.scaling", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert problem in done.stderr and done.stdout == ""
    assert not out.exists()


def test_utilisation_of_a_hand_computed_trace(three_requests: Path) -> None:
    requests = load_trace(three_requests)
    one = simulate(requests, "lru", 8, sequential=False, cost=COST)
    assert one.span_s == 8.0 and one.prefill_busy_s == [2.75] and one.pinned_block_s == [8.5]
    assert one.prefill_utilisations == [2.75 / 8] == [0.34375]
    assert one.kv_utilisations == [8.5 / (8 * 8)] == [0.1328125]
    assert one.utilisations == [0.34375] and one.max_utilisation == 0.34375
    assert one.offered_prefill == 0.34375 and one.offered_load == 0.34375
    # Tenths of 0.8 s: the first holds the first request's 1.25 s of prefill, longer than
    # the tenth, so this sparse trace peaks at 1.5625 and counts as overloaded.
    assert one.peak_prefill_s == [1.25] and one.peak_utilisations == [1.25 / 0.8] == [1.5625]
    assert one.overloaded
    # Sequential mode: the same prefill; nothing stays pinned.
    alone = simulate(requests, "lru", 8, sequential=True, cost=COST)
    assert alone.prefill_busy_s == [2.75] and alone.kv_utilisations == [0.0]
    # Round robin over two: replica 0 serves the first (1.25 s) and third (0.75 s), replica
    # 1 the second with no hit, 0.25 + 1,536 / 1,024 = 1.75 s, pinning 3 blocks for 2.25 s.
    fleet, placed = simulate_fleet(
        requests, "lru", 8, 2, "round_robin", sequential=False, cost=COST
    )
    assert placed == [0, 1, 0]
    assert fleet.prefill_utilisations == [2.0 / 8, 1.75 / 8] == [0.25, 0.21875]
    assert fleet.kv_utilisations == [(3.5 + 1.25) / 64, 6.75 / 64]
    assert fleet.max_utilisation == 0.25 and fleet.offered_load == 3.75 / 8
    assert fleet.peak_prefill_s == [1.25, 1.75]
    row = fleet.as_dict()
    assert row["utilisation"] == [0.25, 0.21875] and row["max_utilisation"] == 0.25
    assert row["offered_prefill"] == 0.46875 and row["offered_kv"] == (4.75 + 6.75) / 64
    assert row["max_peak_utilisation"] == 1.75 / 0.8 and row["overloaded"] is True


def test_peak_utilisation_of_an_even_trace_is_its_utilisation(steady: Path) -> None:
    result = simulate(load_trace(steady), "lru", 40, sequential=False, cost=COST)
    assert result.prefill_busy_s == [30.0] and result.peak_prefill_s == [3.0]
    assert result.utilisations == pytest.approx([30 / 39])
    assert result.peak_utilisations == pytest.approx([3.0 / 3.9])
    assert not result.overloaded


def test_one_arrival_time_has_no_utilisation(write_lines) -> None:
    requests = load_trace(write_lines([mooncake(0, [1]), mooncake(0, [2])]))
    result = simulate(requests, "lru", 4, sequential=False, cost=COST)
    assert result.span_s == 0.0 and result.utilisations is None and not result.overloaded
    assert result.peak_utilisations is None
    assert overload_warnings([{**result.as_dict(), "trace": "t"}]) == []


def test_time_scale_changes_arrival_times_and_nothing_else() -> None:
    requests = load_trace(MOONCAKE_SAMPLE)[:200]
    for factor in (0.5, 3.0):
        scaled = time_scaled(requests, factor)
        assert len(scaled) == len(requests)
        for before, after in zip(requests, scaled, strict=True):
            assert after.timestamp_s == pytest.approx(before.timestamp_s * factor)
            assert dataclasses.replace(after, timestamp_s=before.timestamp_s) == before
    assert time_scaled(requests, 1.0) == requests
    # Sequential mode ignores time: the same hits; the span, and so the utilisation, scales.
    plain = simulate(requests, "arc", 300, sequential=True)
    slow = simulate(time_scaled(requests, 4.0), "arc", 300, sequential=True)
    assert (slow.block_hits, slow.evictions) == (plain.block_hits, plain.evictions)
    assert slow.span_s == pytest.approx(4 * plain.span_s)
    assert slow.max_utilisation == pytest.approx(plain.max_utilisation / 4)


def test_time_scale_on_the_command_line_moves_arrivals_only(three_requests: Path, capsys) -> None:
    rows = {}
    for factor in ("1", "2"):
        argv = ["simulate", str(three_requests), "--policy", "lru", "--capacity", "8"]
        assert main([*argv, *COST_OPTIONS, "--time-scale", factor, "--json"]) == 0
        (rows[factor],) = json.loads(capsys.readouterr().out)
    assert rows["2"]["span_s"] == 16.0 and rows["2"]["max_utilisation"] == 0.34375 / 2
    for same in ("block_hits", "prefill_busy_s", "requests", "evictions", "ttft_p90_s"):
        assert rows["2"][same] == rows["1"][same]


def test_simulate_warns_at_overload_and_not_below(steady: Path, capsys) -> None:
    argv = ["simulate", str(steady), "--policy", "lru", "--capacity", "40", *COST_OPTIONS]
    # Arrivals 0.75 s apart: 4 x 0.75 s of prefill in each tenth of 2.925 s, peak 1.026.
    assert main([*argv, "--time-scale", "0.75"]) == 0
    captured = capsys.readouterr()
    (warning,) = captured.err.splitlines()
    assert warning.startswith("arc-evictor: warning: steady.jsonl on 1 replica is overloaded:")
    assert "offers 1.03 replicas' worth of prefill" in warning
    assert "against a capacity of 1" in warning
    assert "the busiest tenth of the trace needs 1.03 times that tenth" in warning
    # Peak near 0.8: 1.026 / 0.8 = 1.28 times slower (0.75 x 1.28 = 0.96), 1,024 x 1.28 =
    # 1,313 tokens per second (1,400 at 2 digits), and 2 replicas.
    assert "--time-scale 0.97 or more" in warning
    assert "--prefill-tokens-per-second 1,400 or more" in warning
    assert "or 2 or more replicas" in warning
    assert "peak util" in captured.out and "1.03" in captured.out
    # 0.8 s apart: 3 s of prefill in each 3.12 s tenth, peak 0.96.
    assert main([*argv, "--time-scale", "0.8"]) == 0
    assert capsys.readouterr().err == ""


def test_scale_warns_once_per_trace_and_replica_count(steady: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "scale"
    argv = [
        *("scale", "--out", str(out), "--trace", str(steady), "--replicas", "1,2"),
        *("--router", "round_robin,kv_aware", "--policy", "lru,arc", "--cache", "per-replica"),
        *("--capacity", "100", *COST_OPTIONS),
    ]
    # Four times faster: peak 3.08 on one replica, 1.54 on each of two.
    assert main([*argv, "--time-scale", "0.25"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 2
    assert "steady on 1 replica is overloaded (2 of 2 runs)" in warnings[0]
    assert "steady on 2 replicas is overloaded (4 of 4 runs)" in warnings[1]
    assert "offers 3.08 replicas' worth of prefill" in warnings[1]
    assert "against a capacity of 2" in warnings[1]
    rows = json.loads((out / "scale.json").read_text())
    assert {row["trace"] for row in rows} == {"steady"} and all(r["overloaded"] for r in rows)
    two = [row for row in rows if row["replicas"] == 2]
    assert all(row["max_peak_utilisation"] == pytest.approx(1.54, abs=0.01) for row in two)
    assert all(row["time_scale"] == 0.25 for row in rows)
    with (out / "scale.csv").open() as handle:
        first = next(csv.DictReader(handle))
    assert {"max_utilisation", "max_peak_utilisation", "offered_load", "time_scale"} <= set(first)
    assert "peak util" in (out / "scale.txt").read_text()
    assert main([*argv, "--time-scale", "1"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--time-scale", "0"], "--time-scale must be a number in (0, 1000], got 0.0"),
        (["--time-scale", "-2"], "--time-scale must be a number in (0, 1000]"),
        (["--time-scale", "nan"], "--time-scale must be a number in (0, 1000]"),
        (["--time-scale", "1e9"], "--time-scale must be a number in (0, 1000]"),
        (["--prefill-tokens-per-second", "0"], "--prefill-tokens-per-second must be"),
        (["--prefill-tokens-per-second", "inf"], "--prefill-tokens-per-second must be"),
        (["--decode-seconds-per-token", "-1"], "--decode-seconds-per-token must be"),
        (["--step-seconds", "nan"], "--step-seconds must be a finite number >= 0"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens must be a whole number >= 1"),
    ],
)
@pytest.mark.parametrize("command", ["scale", "simulate"])
def test_bad_load_options_are_refused_by_name(
    command: str, args: list[str], problem: str, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "never"
    where = ["--out", str(out)] if command == "scale" else [str(MOONCAKE_SAMPLE)]
    assert main([command, *where, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"arc-evictor: error: {problem}" in captured.err
    assert not out.exists()


def test_a_trace_file_that_is_missing_is_an_unknown_trace(tmp_path: Path, capsys) -> None:
    out = tmp_path / "never"
    missing = tmp_path / "nothing.jsonl"
    assert main(["scale", "--out", str(out), "--trace", f"mooncake,{missing}"]) == 2
    assert f"unknown trace '{missing}'" in capsys.readouterr().err
    assert not out.exists()


def test_a_full_cache_binds_before_the_prefill_lane(write_lines) -> None:
    """10 requests 1 s apart of 2 blocks and 16 output tokens (2 s of decode), on a cache of
    2 blocks, with a prefill of 2**-10 s: each waits for the one before to finish, so each
    pins 2 blocks for 2 + 2**-10 s, one after another."""
    fast = CostModel(prefill_seconds_per_token=2**-20, decode_seconds_per_token=0.125)
    fast = dataclasses.replace(fast, step_seconds=0.0)
    lines = [mooncake(1_000 * k, [2 * k, 2 * k + 1], output=16) for k in range(10)]
    result = simulate(load_trace(write_lines(lines)), "lru", 2, sequential=False, cost=fast)
    assert result.pinned_block_s == [20 * (2 + 2**-10)]
    assert result.kv_utilisations == pytest.approx([40.01953125 / 18])
    assert result.peak_utilisations == result.kv_utilisations  # prefill peaks at 0.002
    (warning,) = overload_warnings([{**result.as_dict(), "trace": "t"}], cost=fast)
    assert "offers 2.22 replicas' worth of KV cache" in warning
    assert "pinned blocks fill its pool 2.22 times over" in warning
    # 2.224 / 0.8 = 2.78, rounded up to 2 digits; 3 replicas.
    assert "--time-scale 2.8 or more, a cache 2.8 times larger (--capacity)" in warning
    assert "or 3 or more replicas" in warning and "prefill-tokens-per-second" not in warning
