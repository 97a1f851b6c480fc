"""Fuzz tests: hypothesis throws random and mutated input at every parser and validator.

Profile ``fuzz`` (registered by ``fuzz_support``, imported here; applied per test with
``fuzz_settings``): derandomized, so
CI replays exactly the same cases every run; no deadline (a case's time varies with the
machine, and speed is ``make bench``'s business); no example database (nothing written to the
tree). Every test sets ``max_examples`` itself and records its case count in ``CASES``, which
the session prints at the end (``-s`` or the terminal summary) for the closing note.

Loading the profile globally would also derandomize other areas' property tests, so it is not
loaded; each fuzz test takes it by name.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the fuzz_support module next to the tests

import fuzz_support  # registers the profile

CASES: Counter[str] = fuzz_support.CASES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fuzz case counts per target, printed at the end of the run."""
    if not CASES:
        return
    terminalreporter.section("fuzz cases per target")
    width = max(len(name) for name in CASES)
    for name, count in sorted(CASES.items()):
        terminalreporter.write_line(f"{name:<{width}}  {count:>7,}")
    terminalreporter.write_line(f"{'total':<{width}}  {sum(CASES.values()):>7,}")
