"""Fixtures shared by every area of the suite."""

from __future__ import annotations

import os
import socket
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


# A person may run a test on the host network on purpose with this variable set to 1.
HOST_NETWORK_VAR = "ARC_TESTS_HOST_NETWORK"
# Addresses off this machine, one of each kind: private ranges and a public one (TEST-NET-1).
OFF_MACHINE = ("10.0.0.1", "172.16.0.1", "192.168.1.1", "192.0.2.1", "2001:db8::1")


def routable_off_machine() -> list[str]:
    """The addresses of OFF_MACHINE this process has a route to. A UDP socket's connect() only
    looks the route up and sends nothing; without a route it fails at once."""
    routable = []
    for address in OFF_MACHINE:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((address, 9))
            except OSError:
                continue
            routable.append(address)
    return routable


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to run where a test could open a connection off this machine: the suite runs in
    a loopback-only network namespace (the Makefile's test targets, cluster/netns.py)."""
    if os.environ.get(HOST_NETWORK_VAR) == "1":
        return
    routable = routable_off_machine()
    if routable:
        pytest.exit(
            f"refusing to run: this network namespace has a route to {', '.join(routable)}, "
            "so a test could reach another machine; run the tests through make (a "
            "loopback-only namespace: make test-fast, or `.venv/bin/python -m cluster.netns -- "
            f".venv/bin/python -m pytest ...`), or set {HOST_NETWORK_VAR}=1 to run on the host "
            "network on purpose",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


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
