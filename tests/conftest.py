"""Fixtures shared by every area of the suite."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from arc_harness.tinymodel import build_tiny_llama

CLUSTER_TESTS = Path(__file__).parent / "cluster"
# The key under which a pytest-xdist worker reports its fuzz case counts (tests/fuzz).
FUZZ_CASES = "fuzz_cases"
_WORKERS_FUZZ_CASES: Counter[str] = Counter()


def print_fuzz_cases(terminalreporter: pytest.TerminalReporter, cases: Mapping[str, int]) -> None:
    """The fuzz case counts per target, as a section of the terminal summary."""
    if not cases:
        return
    terminalreporter.section("fuzz cases per target")
    width = max(len(name) for name in cases)
    for name, count in sorted(cases.items()):
        terminalreporter.write_line(f"{name:<{width}}  {count:>7,}")
    terminalreporter.write_line(f"{'total':<{width}}  {sum(cases.values()):>7,}")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist: a finished worker's fuzz case counts join the controller's."""
    _WORKERS_FUZZ_CASES.update(getattr(node, "workeroutput", {}).get(FUZZ_CASES, {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    print_fuzz_cases(terminalreporter, _WORKERS_FUZZ_CASES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The local control plane's tests run last, in their own order: their cluster (etcd, the
    API server, the controllers, kwok) runs from the first of them to the end of the session,
    and would take CPU from every test after them."""
    items.sort(key=lambda item: item.path.is_relative_to(CLUSTER_TESTS))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local Llama every real vLLM server of the run serves (random weights, a local
    tokenizer, nothing downloaded), built once per run. vLLM serves it under its folder's name,
    ``tiny-llama``, unless a server names it otherwise."""
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
