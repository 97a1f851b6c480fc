"""The plugin's block-pool bench compares like with like (its figures are ``make bench``'s,
not a test's)."""

from __future__ import annotations

from arc_dev.bench.plugin import bench_block_pool


def test_bench_counts_the_same_block_operations_and_lru_decisions_for_every_pool() -> None:
    rows = bench_block_pool(num_blocks=64, requests=120, repeats=1)
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
