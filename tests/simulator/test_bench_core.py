"""The policy-core benchmark's traces and memory figure (speed itself is make bench's)."""

from __future__ import annotations

import pytest

from arc_dev.bench import BENCH_TRACES, bench_trace, retained_bytes


@pytest.mark.parametrize("kind", BENCH_TRACES)
def test_bench_trace_has_about_the_asked_accesses(kind: str) -> None:
    requests = bench_trace(kind, 20_000)
    accesses = sum(request.num_blocks for request in requests)
    assert 0.8 * 20_000 < accesses < 1.25 * 20_000


def test_unknown_bench_trace_is_named() -> None:
    with pytest.raises(ValueError, match="unknown bench trace 'chat'"):
        bench_trace("chat", 1_000)


def test_retained_bytes_grow_with_what_a_policy_remembers() -> None:
    # LRU keeps one order; ARC adds ghosts; trio adds counts, their history and miniatures.
    requests = bench_trace("docqa", 20_000)
    capacity = 300
    lru, arc, trio = (retained_bytes(requests, name, capacity) for name in ("lru", "arc", "trio"))
    assert 0 < lru < arc < trio
