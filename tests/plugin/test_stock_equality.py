"""``lru`` is vLLM's own pool, block ids included; every policy keeps vLLM's per-step rules.

Stock vLLM and the plugin run the same random workload (``workload.drive``) on vLLM's real
KVCacheManager with KV cache events on. With ``lru`` every step's record is equal: the block
ids handed out (same blocks, same order), the hit per group, the free count, the KV events
(BlockStored / BlockRemoved with their group index) and every block's reference count and
hash. KV connector invalidations (``evict_blocks``) are left out of that comparison: vLLM keeps
an invalidated free block at its queue position, the plugin reuses it first
(docs/plugin.md, "Equal to vLLM").

Every other policy differs from vLLM only in which cached block is evicted, so on every layout
it runs the same workload with invalidations and resets, ``verify`` recounting the pool after
each step, and its KV events must replay into exactly vLLM's prefix-cache map.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from managers import SUPPORTED_LAYOUTS, group_block_sizes, make_manager, make_request
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash
from workload import Step, drive, first_difference, tokens

from arc_evictor.policies import policy_names

BS = 4
NUM_BLOCKS = 40


def run(policy: str | None, layout: str, seed: int, steps: int, invalidate: bool) -> list[Step]:
    manager = make_manager(policy, NUM_BLOCKS, BS, layout=layout, events=True)
    check = manager.block_pool.verify if policy is not None else lambda: None
    return drive(manager, seed, steps, BS, invalidate=invalidate, check=check)


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
@pytest.mark.parametrize("seed", range(4))
def test_lru_equals_vllm_block_for_block(layout: str, seed: int) -> None:
    stock = run(None, layout, seed, 300, invalidate=False)
    plugin = run("lru", layout, seed, 300, invalidate=False)
    assert first_difference(stock, plugin) is None
    actions = Counter(step.action for step in stock)
    # The workload reached every path it is meant to compare.
    assert actions["logprobs"] and actions["decode"] and actions["free"] and actions["reset"]
    assert any(isinstance(e, BlockRemoved) for step in stock for e in step.events)
    assert any(step.block_ids is None for step in stock)  # the pool ran full
    if layout.startswith("full*"):
        # Full attention with blocks larger than the hash unit cached a partial block.
        assert any(partial_block_stored(step.events, layout) for step in stock)


def partial_block_stored(events: list, layout: str) -> bool:
    """True if ``events`` store a key for part of a block (a ``cache_partial_block`` key)."""
    sizes = dict(enumerate(size for _, size in group_block_sizes(BS, layout)))
    return any(isinstance(e, BlockStored) and e.block_size < sizes[e.group_idx] for e in events)


@given(seed=st.integers(0, 10**6), layout=st.sampled_from(SUPPORTED_LAYOUTS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_lru_equals_vllm_on_any_seed(seed: int, layout: str) -> None:
    stock = run(None, layout, seed, 120, invalidate=False)
    assert first_difference(stock, run("lru", layout, seed, 120, invalidate=False)) is None


def test_prompt_logprobs_allocate_fresh_blocks_as_vllm_does() -> None:
    # A request with prompt logprobs skips prefix-cache reads. vLLM gives its blocks fresh
    # ids and caches them as second copies; the plugin does the same, with no extra
    # BlockRemoved/BlockStored pair for the blocks already cached.
    prompt = tokens(7, 3 * BS + 1)
    records = {}
    for policy in (None, "lru", "arc"):
        manager = make_manager(policy, 16, BS, events=True)
        first = make_request(prompt, BS)
        manager.allocate_slots(first, first.num_tokens)
        first.num_computed_tokens = first.num_tokens
        manager.free(first)
        manager.take_events()
        again = make_request(prompt, BS, prompt_logprobs=True)
        assert again.skip_reading_prefix_cache
        computed, hit_tokens, _ = manager.get_computed_blocks(again)
        new = manager.allocate_slots(again, again.num_tokens, hit_tokens, computed)
        assert hit_tokens == 0 and new is not None
        records[policy] = (new.get_block_ids(), manager.take_events())
    assert records["lru"] == records[None]
    assert records["arc"] == records[None]
    (ids,), events = records[None]
    assert ids == [4, 5, 6, 7]  # fresh blocks, not the cached 1..3
    assert [type(e) for e in events] == [BlockStored]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_decode_across_a_block_boundary_with_two_block_sizes_equals_vllm(policy: str) -> None:
    # Full attention with 32-token blocks and a sliding window with 16-token blocks: vLLM
    # hashes every 16 tokens and caches per 32. A 60-token prompt's decode reaches 64
    # computed tokens on its 4th step; full attention then caches block 1 and registers the
    # prompt's last 16-token boundary (48 tokens) as a partial key of that block.
    records = {}
    for name in (None, policy):
        manager = make_manager(name, 24, 16, layout="full*2+swa", events=True)
        request = make_request(tokens(3, 60), 16)
        computed, hit_tokens, _ = manager.get_computed_blocks(request)
        manager.allocate_slots(request, 60, hit_tokens, computed)
        request.num_computed_tokens = 60
        steps = [manager.take_events()]
        for token in tokens(4, 6):
            request.append_output_token_ids(token)
            new = manager.allocate_slots(request, 1)
            assert new is not None
            request.num_computed_tokens += 1
            steps.append((new.get_block_ids(), manager.take_events()))
            if name is not None:
                manager.block_pool.verify()
        manager.free(request)
        again = make_request(tokens(3, 60) + tokens(5, 40), 16)
        computed, hit_tokens, _ = manager.get_computed_blocks(again)
        steps.append((hit_tokens, computed.get_block_ids()))
        records[name] = steps
    assert records[policy] == records[None]
    _, fourth_events = records[None][4]
    # (event, block size, group): full attention's block 1, its partial key, the window's block.
    assert [(type(e), e.block_size, e.group_idx) for e in fourth_events] == [
        (BlockStored, 32, 0),
        (BlockStored, 16, 0),
        (BlockStored, 16, 1),
    ]
    assert records[None][-1][0] == 32  # the cached block and its window hit again


def replay_events(events: list, cached: Counter) -> None:
    """Apply KV events to a count of cached copies per (hash, group)."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            cached.clear()
        elif isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                cached[block_hash, event.group_idx] += 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                cached[block_hash, event.group_idx] -= 1
                assert cached[block_hash, event.group_idx] >= 0, "removed more than stored"


def drive_checked(policy: str, layout: str, seed: int, steps: int) -> tuple[list[Step], Any]:
    """Run the workload with invalidations; after each step ``verify`` recounts the pool and
    the KV events so far must replay into exactly the copies vLLM's prefix-cache map holds
    (partial-block keys included)."""
    manager = make_manager(policy, NUM_BLOCKS, BS, layout=layout, events=True)
    pool = manager.block_pool
    cached: Counter = Counter()

    def check() -> None:
        pool.verify()
        replay_events(manager.take_events(), cached)
        # Every key vLLM's map holds: each block's hash and its partial-block keys.
        keys = [b.block_hash for b in pool.blocks if b.block_hash is not None]
        keys += [key for further in pool.cached_block_hashes_by_block.values() for key in further]
        held = Counter(
            (maybe_convert_block_hash(get_block_hash(key)), get_group_id(key)) for key in keys
        )
        assert +cached == held

    return drive(manager, seed, steps, BS, invalidate=True, check=check), pool


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_keeps_vllms_rules_on_every_layout(layout: str, policy: str) -> None:
    records, pool = drive_checked(policy, layout, 11, 300)
    actions = Counter(step.action for step in records)
    assert actions["evict_blocks"] and actions["reset"] and actions["logprobs"]
    assert sum(step.hit_tokens for step in records) > 0
    assert sum(pool.policy.counters.evictions.values()) > 0


@given(
    seed=st.integers(0, 10**6),
    layout=st.sampled_from(SUPPORTED_LAYOUTS),
    policy=st.sampled_from(policy_names()),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_policy_keeps_vllms_rules_on_any_seed(seed: int, layout: str, policy: str) -> None:
    drive_checked(policy, layout, seed, 120)
