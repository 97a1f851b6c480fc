"""Keys decided after allocation (decode fills a block), second copies of a key, pending keys.

These are the policy pool's rare paths: the hot loops hand them to helpers, so each gets its own
behaviour test with the pool's invariants recounted after every step.
"""

from __future__ import annotations

import random

import pytest
from harness import admit, make_manager, make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes
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


@pytest.mark.parametrize("policy", POLICIES)
def test_decoded_block_replaces_an_idle_cached_copy_of_its_key(policy: str) -> None:
    manager = make_manager(policy, num_blocks=16, block_size=BS)
    pool = manager.block_pool
    text = tokens(2, 8)
    first = make_request([*text, 5], BS)
    admit(manager, first)
    manager.free(first)
    old_copy = manager.block_pool.get_cached_block(first.block_hashes[1], [0])
    assert old_copy is not None
    second = make_request(text[:6], BS)
    assert admit(manager, second) == 1
    decode(manager, second, text[6:8])
    # The held block took the key over; the idle copy went back to the free queue, unhashed.
    assert old_copy[0].block_hash is None and old_copy[0].ref_cnt == 0
    assert len(pool.policy) == 2
    manager.free(second)
    pool.verify()
    assert probe_hits(manager, [*text, 6]) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_second_copies_stay_while_held_and_a_survivor_keeps_the_key(policy: str) -> None:
    manager = make_manager(policy, num_blocks=16, block_size=BS)
    pool = manager.block_pool
    text = tokens(3, 8)
    holder = make_request([*text, 5], BS)
    admit(manager, holder)
    copies = [make_request(text[:6], BS) for _ in range(2)]
    for request in copies:
        assert admit(manager, request) == 1
        decode(manager, request, text[6:8])  # a second, then a third copy of the held key
    assert len(pool.policy) == 2
    manager.free(holder)  # the primary goes; the oldest copy takes its place
    pool.verify()
    manager.free(copies[0])
    pool.verify()
    manager.free(copies[1])  # the last copy stays cached, now evictable
    pool.verify()
    assert len(pool.policy) == 2 and pool.get_num_free_blocks() == 15
    assert probe_hits(manager, [*text, 6]) == 2


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
