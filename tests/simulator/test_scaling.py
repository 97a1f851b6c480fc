"""The scaling study as a user runs it: narrowed, its outputs, and its bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from arc_simulator.cli import main
from arc_simulator.scaling import per_replica_capacity


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
