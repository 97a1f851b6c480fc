"""Local fleet servers each get a core of their own while the machine has enough
(``arc_harness.fleet.engine_core``): vLLM's automatic binding would put every CPU server's
engine on the first core."""

from __future__ import annotations

import os

import pytest

from arc_harness.fleet import engine_core


def test_each_server_gets_its_own_core_and_they_wrap_around() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert [engine_core(i) for i in range(len(cores))] == cores
    assert engine_core(len(cores)) == cores[0]


def test_only_cores_this_process_may_use_are_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("arc_harness.fleet.os.sched_getaffinity", lambda pid: {5, 3})
    assert [engine_core(i) for i in range(3)] == [3, 5, 3]
