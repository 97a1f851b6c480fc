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

from collections import Counter

import fuzz_support  # registers the profile
import pytest

from tests.conftest import FUZZ_CASES, print_fuzz_cases

CASES: Counter[str] = fuzz_support.CASES


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker, hand the counts to the controller (tests/conftest.py)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[FUZZ_CASES] = dict(CASES)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fuzz case counts per target, printed at the end of a run in one process."""
    print_fuzz_cases(terminalreporter, CASES)
