"""The per-step and memory benches compare like with like (their figures are ``make bench``'s,
not a test's): the same stream and LRU decisions for vLLM's pool and the plugin's, vLLM's pool
run without the plugin's wrappers, a warm-up that evicts, and a memory walk that counts what
tracemalloc counts."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from vllm.v1.core import kv_cache_manager
from vllm.v1.core.block_pool import BlockPool

from arc_dev.bench import step
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool

# 2,000 blocks hold 8 running requests (at most 84 blocks each) and a cache that must evict.
SMALL = step.StepSettings(2_000, 8, step.warmup_steps_for(2_000, 8), 30)


def test_native_rows_run_vllms_pool_without_the_plugins_wrappers() -> None:
    manager = step.make_manager(step.NATIVE, 2_000, 1_344)
    assert type(manager.block_pool) is BlockPool
    patched = kv_cache_manager.KVCacheManager.allocate_slots
    with step.stock_vllm():
        assert kv_cache_manager.KVCacheManager.allocate_slots is patched.__wrapped__
        assert not hasattr(kv_cache_manager.KVCacheManager.allocate_slots, "__wrapped__")
    assert kv_cache_manager.KVCacheManager.allocate_slots is patched
    assert isinstance(step.make_manager("arc", 2_000, 1_344).block_pool, PolicyBlockPool)


def test_native_and_plugin_lru_replay_the_same_steps_with_the_same_hits() -> None:
    native = step.replay(step.NATIVE, SMALL)
    lru = step.replay("lru", SMALL)
    arc = step.replay("arc", SMALL)
    assert len(native.step_seconds) == len(lru.step_seconds) == SMALL.timed_steps
    assert native.block_ops == lru.block_ops == arc.block_ops > 0
    assert native.queried_blocks == lru.queried_blocks == arc.queried_blocks > 0
    assert native.hit_blocks == lru.hit_blocks > 0  # the same LRU decisions
    assert all(seconds >= 0 for seconds in native.step_seconds + lru.step_seconds)
    assert sum(lru.step_seconds) > 0


def test_the_timed_steps_start_on_a_full_pool_that_evicts() -> None:
    seen: list[tuple[int, int]] = []

    def read(manager: kv_cache_manager.KVCacheManager) -> None:
        pool = manager.block_pool
        assert isinstance(pool, PolicyBlockPool)
        seen.append((sum(pool.policy.counters.evictions.values()), len(pool.policy)))

    step.replay("lru", SMALL, on_warm=read)
    ((evictions, resident),) = seen
    assert evictions > 0
    # Every block but the null block holds a key, apart from the partial last blocks of the
    # running requests' decodes.
    assert resident >= SMALL.num_blocks - 1 - SMALL.batch


@pytest.mark.parametrize("policy", ["lru", "arc", "trio"])
def test_plugin_bytes_are_what_tracemalloc_counts_over_vllms_own(policy: str) -> None:
    settings = step.StepSettings(SMALL.num_blocks, SMALL.batch, SMALL.warmup_steps, 1)
    traced: dict[str, int] = {}

    def measure(manager: kv_cache_manager.KVCacheManager, name: str) -> None:
        gc.collect()
        traced[name] = tracemalloc.get_traced_memory()[0]
        if isinstance(manager.block_pool, PolicyBlockPool):
            traced["walk"] = step.plugin_bytes(manager.block_pool)

    for name in (step.NATIVE, policy):
        gc.collect()
        tracemalloc.start()
        try:
            step.replay(name, settings, on_warm=lambda manager, name=name: measure(manager, name))
        finally:
            tracemalloc.stop()
    difference = traced[policy] - traced[step.NATIVE]
    assert difference > 0
    assert traced["walk"] == pytest.approx(difference, rel=0.05)


def test_step_rows_put_each_policy_beside_native_and_a_10_ms_step() -> None:
    rows = step.bench_steps(pools=(2_000,), batches=(8,), timed_steps=10, repeats=1)
    assert [row["pool"] for row in rows] == [step.NATIVE, "lru", "arc", "trio"]
    native = rows[0]
    assert native["added_us"] is None and native["added_share"] is None
    for row in rows[1:]:
        assert row["added_us"] == pytest.approx(row["us_per_step"] - native["us_per_step"])
        assert row["added_share"] == pytest.approx(row["added_us"] * 1e-6 / 0.010)
        assert row["block_ops_per_step"] == native["block_ops_per_step"] > 0


def test_memory_rows_give_a_share_of_a_7_to_8b_models_block() -> None:
    rows = step.bench_memory(pools=(2_000,), batch=8)
    assert [row["policy"] for row in rows] == ["lru", "arc", "trio"]
    lru, arc, _trio = rows
    assert lru["ghosts"] == 0 < arc["ghosts"]  # ARC remembers evicted keys, LRU none
    assert arc["bytes_per_block"] > lru["bytes_per_block"] > 0
    for row in rows:
        for model, share in row["kv_share"].items():
            assert share == pytest.approx(row["bytes_per_block"] / step.MODEL_BLOCK_BYTES[model])
