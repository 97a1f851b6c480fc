"""The plugin's block-pool bench compares like with like (its figures are ``make bench``'s,
not a test's)."""

from __future__ import annotations

import pytest

from arc_dev.bench.plugin import (
    bench_block_pool,
    document_qa_requests,
    policy_calls,
    replay_policy_calls,
)
from arc_evictor.policies import make_policy
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool, build_block_pool


def test_bench_counts_the_same_block_operations_and_lru_decisions_for_every_pool() -> None:
    # The best of three runs each: one run of so small a replay can lose a time slice to the
    # machine and put the policy's calls alone above the whole replay.
    rows = bench_block_pool(num_blocks=64, requests=120, repeats=3)
    assert [(row["pool"], row["policy"]) for row in rows] == [
        ("vllm-native", "lru"),
        ("plugin", "lru"),
        ("plugin", "arc"),
        ("plugin", "trio"),
    ]
    # 10 prompt blocks per request, each looked up or allocated, then cached or touched, freed.
    assert {row["block_ops"] for row in rows} == {120 * 10 * 3}
    native, lru, _arc, _trio = rows
    assert native["hit_blocks"] == lru["hit_blocks"] > 0  # same stream, same LRU decisions
    assert native["ratio_vs_native"] == 1.0
    assert all(row["ns_per_block_op"] > 0 for row in rows)
    assert native["policy_ns_per_block_op"] is None
    # The policy's calls replayed alone are part of what the whole replay did.
    assert all(0 < row["policy_ns_per_block_op"] < row["ns_per_block_op"] for row in rows[1:])


@pytest.mark.parametrize("name", ["lru", "arc", "trio"])
def test_the_recorded_policy_calls_replayed_alone_make_the_pools_decisions(name: str) -> None:
    pool = build_block_pool(64, 16, name)
    assert isinstance(pool, PolicyBlockPool)
    policy = pool.policy
    calls = policy_calls(pool, 16, document_qa_requests(120, 16, 0))
    assert {call for call, _ in calls} >= {"touch", "allocate", "release"}
    fresh = make_policy(name, 63)
    replay_policy_calls(fresh, calls)
    assert list(fresh.resident_keys()) == list(policy.resident_keys())
    assert fresh.counters.evictions == policy.counters.evictions
