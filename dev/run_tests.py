"""Run every test once, in the stages ``make test`` runs, and print each stage's status and time.

Every pytest run is in a loopback-only network namespace of its own (``python -m
cluster.netns``): no test can open a connection off this machine. The stages, in order:

1. the tests marked ``exclusive`` (they judge latency or timing against fixed bounds), one at a
   time; beside them, at the lowest CPU priority (nice 19), the tests that start no server and
   no cluster, on every core, idle workers stealing queued tests, so that they take only the
   CPU the exclusive tests leave idle while those wait on alert timers, replays and leases
   (report kept in out/test-fast.log);
2. the server tests (vLLM, Locust, marked slow), two modules at a time, with ``tests/cluster``
   on the local control plane beside them: both spend most of their time waiting on paced
   replays, alert timers, leases and start-ups (report kept in out/test-cluster.log);
3. alone, the README's used-by path on the local cluster's real node (``tests/e2e``): its
   replays are paced to the engine pods' measured speed, so nothing else may run beside it.

Each kept report is printed after its stage. Exits 1 if any run failed.

Usage: ``python dev/run_tests.py`` (after ``make test``'s set-up; ``make test`` runs it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "out"
SERVER_TESTS = "vllm or locust or slow"
PYTEST = [sys.executable, "-m", "cluster.netns", "--", sys.executable, "-m", "pytest"]


@dataclass
class Run:
    """One pytest run: started in the background with its report in ``log``, or in the
    foreground (``log`` None) with its report on this terminal."""

    name: str
    args: list[str]
    log: Path | None = None
    nice: bool = False
    started: float = field(default=0.0, init=False)
    seconds: float = field(default=0.0, init=False)
    status: int = field(default=-1, init=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> Run:
        command = (["nice", "-n", "19"] if self.nice else []) + PYTEST + self.args
        self.started = time.monotonic()
        if self.log is None:
            print(f"===== {self.name} =====", flush=True)
            self._process = subprocess.Popen(command, cwd=REPO)
        else:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("wb") as report:
                self._process = subprocess.Popen(
                    command, cwd=REPO, stdout=report, stderr=subprocess.STDOUT
                )
            print(f"{self.name}: running in the background ({self.log.relative_to(REPO)})",
                  flush=True)  # fmt: skip
        return self

    def wait(self) -> int:
        assert self._process is not None, f"{self.name} was not started"
        self.status = self._process.wait()
        self.seconds = time.monotonic() - self.started
        if self.log is not None:
            print(f"===== {self.name} ({self.log.relative_to(REPO)}) =====", flush=True)
            sys.stdout.write(self.log.read_text(errors="replace"))
        print(f"===== {self.name}: exit {self.status} in {minutes(self.seconds)} =====", flush=True)
        return self.status


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def stages() -> list[tuple[Run, Run | None]]:
    """Each stage: its foreground run and the run beside it."""
    durations = "--durations=15"
    elsewhere = ["--ignore=tests/cluster", "--ignore=tests/e2e"]
    no_server = ["-n", "auto", "--dist", "worksteal", "-m", f"not ({SERVER_TESTS})"]
    server = ["-n", "2", "--dist", "loadfile", "-m", f"({SERVER_TESTS}) and not exclusive"]
    return [
        (
            Run("exclusive", ["-m", "exclusive", durations]),
            Run("no-server", [*no_server, *elsewhere, durations], OUT / "test-fast.log", True),
        ),
        (
            Run("server", [*server, *elsewhere, durations]),
            Run(
                "cluster",
                ["tests/cluster", "-m", "not exclusive", durations],
                OUT / "test-cluster.log",
            ),
        ),
        (Run("e2e", ["tests/e2e", "--durations=0"]), None),
    ]


def main() -> int:
    started = time.monotonic()
    runs: list[Run] = []
    for foreground, beside in stages():
        if beside is not None:
            beside.start()
        foreground.start().wait()
        if beside is not None:
            beside.wait()
        runs += [foreground] + ([beside] if beside else [])
    summary = ", ".join(f"{r.name} {r.status} ({minutes(r.seconds)})" for r in runs)
    print(f"make test: {summary}; {minutes(time.monotonic() - started)} in all")
    return 0 if all(r.status == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
