"""`make bench-cluster` at a small scale: the benchmark runs its three phases on a control
plane of its own and prints every figure of its summary (the figures themselves are not
judged: docs/benchmarks.md reports them at 100 ServingPolicies)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.helpers import REPO

pytestmark = pytest.mark.slow

SUMMARY_ROWS = [
    "create: every status observed",
    "create: every router lists its ready pods",
    "steady: applies that changed a child/min",
    "delete: every Deployment 2/2 ready",
    "operator peak RSS",
]


def test_the_cluster_bench_runs_its_three_phases(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "cluster.bench", "--out", str(tmp_path / "bench"),
               "--policies", "3", "--replicas", "2", "--window", "5",
               "--status-interval", "2"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "== summary: 3 ServingPolicies x 2 replicas" in done.stdout
    for row in SUMMARY_ROWS:
        assert row in done.stdout, row


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--policies", "0"], "--policies must be at least 1, got 0"),
        (["--replicas", "1"], "--replicas must be at least 2 (each policy gets a router), got 1"),
        (["--window", "-5"], "--window must be 0 or more seconds, got -5.0"),
        (["--delete-fraction", "2"], "--delete-fraction must be in (0, 1], got 2.0"),
        (["--poll", "0"], "--poll must be positive, got 0.0"),
    ],
)
def test_bad_options_are_refused_before_any_cluster_starts(
    tmp_path: Path, option: list[str], message: str
) -> None:
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "cluster.bench", "--out", str(out), *option],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not out.exists()
