"""The arc-evictor command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.cli import main

SAMPLE = MOONCAKE_SAMPLE


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arc_simulator.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def chat_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "chat.jsonl"
    assert (
        main(["generate", "conversation", "--out", str(path), "--sessions", "40", "--seed", "2"])
        == 0
    )
    return path


def test_simulate_prints_json_rows_per_policy_and_capacity(chat_trace) -> None:
    done = run(
        "simulate",
        str(chat_trace),
        "--policy",
        "lru,arc,belady",
        "--capacity",
        "300,10%",
        "--sequential",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len(rows) == 6
    assert {row["policy"] for row in rows} == {"lru", "arc", "belady"}
    for row in rows:
        assert 0.0 <= row["block_hit_rate"] <= 1.0 and 0.0 <= row["token_hit_rate"] <= 1.0
        assert row["mode"] == "sequential"
    arc = [row for row in rows if row["policy"] == "arc"]
    assert all(row["final_p"] is not None for row in arc)


def test_overlapping_mode_reports_ttft_percentiles(chat_trace, capsys) -> None:
    assert main(["simulate", str(chat_trace), "--policy", "lru", "--capacity", "20%"]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 ms" in out and "overlapping mode" in out


def test_plot_is_written(chat_trace, tmp_path, capsys) -> None:
    target = tmp_path / "curve.png"
    assert (
        main(
            [
                "simulate",
                str(chat_trace),
                "--capacity",
                "5%,20%",
                "--sequential",
                "--plot",
                str(target),
            ]
        )
        == 0
    )
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_policy_exits_2_naming_the_valid_ones(chat_trace) -> None:
    done = run("simulate", str(chat_trace), "--policy", "lru,lfu")
    assert done.returncode == 2
    assert "unknown eviction policy 'lfu'" in done.stderr
    assert "lru, dbl, arc" in done.stderr and "belady" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_malformed_trace_line_exits_2_with_file_and_line(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(SAMPLE.read_text().splitlines()[0] + '\n{"timestamp": 5,\n')
    done = run("simulate", str(bad))
    assert done.returncode == 2
    assert f"{bad}:2: not valid JSON" in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("capacity", ["0", "ten", "-5%", "5%,x"])
def test_bad_capacity_exits_2(chat_trace, capacity, capsys) -> None:
    assert main(["simulate", str(chat_trace), f"--capacity={capacity}"]) == 2
    assert "--capacity" in capsys.readouterr().err


def test_bad_cost_model_exits_2(chat_trace, capsys) -> None:
    assert main(["simulate", str(chat_trace), "--prefill-tokens-per-second", "0"]) == 2
    assert "error" in capsys.readouterr().err


def test_generate_rejects_bad_parameters_without_writing(tmp_path, capsys) -> None:
    target = tmp_path / "never.jsonl"
    assert main(["generate", "docqa", "--out", str(target), "--documents", "0"]) == 2
    assert "documents must be a finite number > 0" in capsys.readouterr().err
    assert not target.exists()


def test_sample_trace_simulates_from_the_command_line() -> None:
    done = run(
        "simulate",
        str(SAMPLE),
        "--policy",
        "lru,arc",
        "--capacity",
        "4000",
        "--sequential",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    lru, arc = json.loads(done.stdout)
    assert lru["requests"] == arc["requests"] == 3993
    assert 0.2 < lru["block_hit_rate"] < arc["block_hit_rate"] < 0.35


def test_plot_into_an_unwritable_place_exits_2_before_simulating(chat_trace, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["simulate", str(chat_trace), "--plot", str(blocker / "sub" / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot" in captured.err and "capacity" not in captured.out


def test_generate_into_a_missing_folder_exits_2(tmp_path, capsys) -> None:
    target = tmp_path / "missing" / "deeper" / "x.jsonl"
    target.parent.parent.write_text("")  # a file where a folder should be
    assert main(["generate", "docqa", "--out", str(target), "--documents", "3"]) == 2
    assert "cannot write" in capsys.readouterr().err
