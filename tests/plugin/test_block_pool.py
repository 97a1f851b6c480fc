"""The plugin inside vLLM's real KVCacheManager: invariants, hits and evictions per policy."""

from __future__ import annotations

import random

import pytest
from managers import admit, make_manager, make_request

from arc_evictor.policies import policy_names

BS = 4  # tokens per block in these tests (vLLM's manager takes any size without a model)
POLICIES = policy_names()


def doc(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 30_000) for _ in range(blocks * BS)]


@pytest.mark.parametrize("policy", POLICIES)
def test_repeated_prompt_hits_all_but_last_block(policy: str) -> None:
    manager = make_manager(policy, num_blocks=16, block_size=BS)
    pool = manager.block_pool
    tokens = doc(1, 5)
    first, second = make_request(tokens, BS), make_request(tokens, BS)
    assert admit(manager, first) == 0
    manager.free(first)
    # vLLM recomputes the last prompt token, so the last block is never a hit.
    assert admit(manager, second) == 4
    manager.free(second)
    pool.verify()
    assert pool.block_hits == 4
    assert pool.block_queries == 10
    # As in vLLM, the recomputed last block is a second cached copy (vLLM never
    # de-duplicates: block tables are append-only); each copy is its own policy entry.
    assert len(pool.policy) == 6
    assert len(pool.prefix_cache_keys()) == 5
    assert pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("policy", POLICIES)
def test_free_count_is_exact_while_requests_hold_blocks(policy: str) -> None:
    manager = make_manager(policy, num_blocks=12, block_size=BS)
    pool = manager.block_pool
    a, b = make_request(doc(2, 4), BS), make_request(doc(3, 4), BS)
    admit(manager, a)
    admit(manager, b)
    pool.verify()
    assert pool.get_num_free_blocks() == 11 - 8
    too_big = make_request(doc(4, 4), BS)
    assert admit(manager, too_big) is None  # refused, and nothing changed
    pool.verify()
    assert pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="Cannot get 4 free blocks"):
        pool.get_new_blocks(4)
    pool.verify()
    manager.free(a)
    manager.free(b)
    pool.verify()
    assert pool.get_num_free_blocks() == 11


def test_lru_evicts_least_recently_released_tail_first() -> None:
    manager = make_manager("lru", num_blocks=7, block_size=BS)  # 6 cacheable blocks
    pool = manager.block_pool
    old, new = doc(5, 3), doc(6, 3)
    for tokens in (old, new):
        request = make_request(tokens, BS)
        admit(manager, request)
        manager.free(request)
    # A 1-block prompt evicts the least recently released block: old's tail.
    one = make_request(doc(7, 1), BS)
    admit(manager, one)
    manager.free(one)
    probe = make_request(old, BS)
    assert admit(manager, probe) == 2  # old's first two blocks survived, its tail did not
    manager.free(probe)
    pool.verify()


def test_arc_keeps_a_reused_prefix_that_lru_evicts() -> None:
    hot = doc(8, 3)
    hits = {}
    for policy in ("lru", "arc"):
        manager = make_manager(policy, num_blocks=9, block_size=BS)  # 8 cacheable blocks
        total = 0
        for step in range(12):
            # The hot document twice, then a scan of cold documents larger than the cache.
            tokens = hot if step % 4 < 2 else doc(100 + step, 4)
            request = make_request(tokens + doc(500 + step, 1), BS)
            total += admit(manager, request)
            manager.free(request)
            manager.block_pool.verify()
        hits[policy] = total
    assert hits["arc"] > hits["lru"], hits


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_random_concurrent_requests_keep_every_invariant(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    manager = make_manager(policy, num_blocks=24, block_size=BS)
    pool = manager.block_pool
    docs = [doc(1000 * seed + i, rng.randint(1, 6)) for i in range(10)]
    running: list = []
    for _ in range(400):
        action = rng.random()
        if action < 0.55 or not running:
            tokens = list(rng.choice(docs)) + doc(rng.randrange(10**6), rng.randint(0, 2))
            tokens += [7] * rng.randint(0, BS - 1)  # a partial last block now and then
            request = make_request(tokens, BS)
            if admit(manager, request) is not None:
                running.append(request)
        elif action < 0.95:
            manager.free(running.pop(rng.randrange(len(running))))
        elif action < 0.98:
            held = [b.block_id for b in pool.blocks if b.block_hash is not None]
            if held:
                manager.evict_blocks(set(rng.sample(held, min(2, len(held)))))
        else:
            name = rng.choice(POLICIES)
            pool.switch_policy(name)
        pool.verify()
    for request in running:
        manager.free(request)
    pool.verify()
    assert pool.get_num_free_blocks() == 23
    assert manager.reset_prefix_cache()
    pool.verify()
    assert len(pool.policy) == 0 and pool.get_num_free_blocks() == 23


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_prefix_cache_refused_while_blocks_are_held(policy: str) -> None:
    manager = make_manager(policy, num_blocks=10, block_size=BS)
    held = make_request(doc(9, 2), BS)
    admit(manager, held)
    assert not manager.reset_prefix_cache()
    manager.block_pool.verify()
    manager.free(held)
    assert manager.reset_prefix_cache()
    again = make_request(doc(9, 2), BS)
    assert admit(manager, again) == 0  # the cache was really emptied
    manager.free(again)


def test_live_switch_carries_resident_blocks_and_pins() -> None:
    manager = make_manager("lru", num_blocks=16, block_size=BS)
    pool = manager.block_pool
    idle, busy = doc(10, 3), doc(11, 3)
    request = make_request(idle, BS)
    admit(manager, request)
    manager.free(request)
    running = make_request(busy, BS)
    admit(manager, running)
    pool.switch_policy("arc")
    pool.verify()
    assert pool.policy.name == "arc" and len(pool.policy) == 6
    assert pool.get_num_free_blocks() == 15 - 3
    manager.free(running)
    probe = make_request(idle, BS)
    assert admit(manager, probe) == 2
    manager.free(probe)
    pool.verify()


def test_unknown_policy_on_switch_changes_nothing() -> None:
    manager = make_manager("arc", num_blocks=8, block_size=BS)
    pool = manager.block_pool
    before = pool.policy
    with pytest.raises(ValueError, match="valid policies: lru"):
        pool.switch_policy("fifo")
    assert pool.policy is before and pool.policy_switches == 0
