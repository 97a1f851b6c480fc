"""Keys decided after allocation (decode fills a block), further copies of a key, pending keys.

These are the policy pool's rare paths: the hot loops hand them to helpers, so each gets its own
behaviour test with the pool's invariants recounted after every step.
"""

from __future__ import annotations

import random

import pytest
from managers import admit, make_manager, make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    make_block_hash_with_group_id,
    resolve_block_hashes,
)
from vllm.v1.request import Request

from arc_evictor.policies import policy_names
from arc_evictor.vllm_plugin.block_pool import Allocation

BS = 4
POLICIES = policy_names()


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 30_000) for _ in range(count)]


def decode(manager: KVCacheManager, request: Request, new_tokens: list[int]) -> None:
    """Generate ``new_tokens`` one step at a time, as the scheduler does after a prefill."""
    for token in new_tokens:
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.block_pool.verify()


def probe_hits(manager: KVCacheManager, prompt: list[int]) -> int:
    request = make_request(prompt, BS)
    hits = admit(manager, request)
    assert hits is not None
    manager.free(request)
    return hits


@pytest.mark.parametrize("policy", POLICIES)
def test_block_filled_by_decode_is_cached_and_hit_later(policy: str) -> None:
    manager = make_manager(policy, num_blocks=16, block_size=BS)
    pool = manager.block_pool
    text = tokens(1, 8)
    request = make_request(text[:6], BS)  # one full block, one partial
    admit(manager, request)
    assert len(pool.policy) == 1
    decode(manager, request, text[6:8])  # the partial block fills and gets its key now
    assert len(pool.policy) == 2
    manager.free(request)
    pool.verify()
    assert probe_hits(manager, [*text, 5]) == 2
    pool.verify()


def copies_in_vllm(manager: KVCacheManager, block_hash: bytes) -> int:
    """How many blocks vLLM's prefix-cache map holds for ``block_hash`` (group 0)."""
    cached = manager.block_pool.cached_block_hash_to_block._cache.get(
        make_block_hash_with_group_id(block_hash, 0)
    )
    return 0 if cached is None else 1 if isinstance(cached, KVCacheBlock) else len(cached)


@pytest.mark.parametrize("policy", POLICIES)
def test_decoded_block_with_an_idle_cached_key_becomes_a_second_copy(policy: str) -> None:
    manager = make_manager(policy, num_blocks=16, block_size=BS)
    pool = manager.block_pool
    text = tokens(2, 8)
    first = make_request([*text, 5], BS)
    admit(manager, first)
    manager.free(first)
    (old_copy,) = pool.get_cached_block(first.block_hashes[1], [0]) or [None]
    assert old_copy is not None
    second = make_request(text[:6], BS)
    assert admit(manager, second) == 1
    decode(manager, second, text[6:8])
    # As in vLLM, the idle copy stays cached and evictable; the filled block is a second
    # copy with its own policy entry.
    assert old_copy.block_hash is not None and old_copy.ref_cnt == 0
    assert copies_in_vllm(manager, first.block_hashes[1]) == 2
    assert len(pool.policy) == 3
    manager.free(second)
    pool.verify()
    assert probe_hits(manager, [*text, 6]) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_each_copy_is_released_and_evicted_on_its_own(policy: str) -> None:
    manager = make_manager(policy, num_blocks=12, block_size=BS)
    pool = manager.block_pool
    text = tokens(3, 8)
    holder = make_request([*text, 5], BS)
    admit(manager, holder)
    copies = [make_request(text[:6], BS) for _ in range(2)]
    for request in copies:
        assert admit(manager, request) == 1
        decode(manager, request, text[6:8])  # a second, then a third copy of the held key
    assert len(pool.policy) == 4 and copies_in_vllm(manager, holder.block_hashes[1]) == 3
    for request in (holder, *copies):
        manager.free(request)
        pool.verify()
    assert len(pool.policy) == 4 and pool.get_num_free_blocks() == 11
    # Unique prompts fill the pool: each eviction removes one copy, and the prefix stays a
    # hit while one is left.
    fillers = iter(range(100, 150))
    key = holder.block_hashes[1]
    while copies_in_vllm(manager, key) == 3:
        probe_hits(manager, tokens(next(fillers), BS))  # one block each
    assert copies_in_vllm(manager, key) == 2
    pool.verify()
    assert probe_hits(manager, [*text, 6]) == 2
    pool.verify()


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_allocated_but_never_cached_leave_the_policy_when_freed(policy: str) -> None:
    manager = make_manager(policy, num_blocks=16, block_size=BS)
    pool = manager.block_pool
    request = make_request(tokens(4, 9), BS)
    assert manager.allocate_slots(request, 9, delay_cache_blocks=True) is not None
    pool.verify()
    assert len(pool.policy) == 2  # decided at allocation, pinned, not yet in vLLM's map
    manager.free(request)
    pool.verify()
    assert len(pool.policy) == 0 and pool.get_num_free_blocks() == 15
    assert probe_hits(manager, tokens(4, 9)) == 0


def test_allocation_keys_are_vllms_block_keys() -> None:
    request = make_request(tokens(5, 5 * BS), BS)
    allocation = Allocation(request)
    allocation.start, allocation.block_size, allocation.group_id = 1, BS, 3
    expected = [make_block_hash_with_group_id(h, 3) for h in request.block_hashes[1:]]
    assert allocation.keys(BS, 6) == [*expected, None, None]
    # A group whose blocks span two hash blocks sees the hashes at its own block size.
    allocation.start, allocation.block_size = 1, 2 * BS
    coarse = resolve_block_hashes(request.block_hashes, BS, 2 * BS)
    assert allocation.keys(BS, 2) == [make_block_hash_with_group_id(coarse[1], 3), None]
    allocation.start = None
    assert allocation.keys(BS, 2) == [None, None]
