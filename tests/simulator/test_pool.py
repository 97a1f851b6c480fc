"""The block-pool model: counts and pins belong to the pool, order to the policy."""

from __future__ import annotations

import random

import pytest

from arc_evictor.policies import EvictionPolicy, make_policy, policy_names
from arc_simulator.pool import BlockPool, PoolExhausted


def pool_of(name: str, capacity: int) -> BlockPool:
    return BlockPool(make_policy(name, capacity))


@pytest.mark.parametrize("name", policy_names())
def test_free_blocks_are_used_before_any_eviction(name) -> None:
    pool = pool_of(name, 4)
    for key in (1, 2, 3):
        pool.take([key])
        pool.give_back([key])
    assert pool.num_free == 1 and pool.evictions == 0
    pool.take([4])
    pool.give_back([4])
    assert pool.num_free == 0 and pool.evictions == 0
    pool.take([5])
    assert pool.evictions == 1
    pool.verify()


@pytest.mark.parametrize("name", policy_names())
def test_a_pinned_block_is_never_evicted(name) -> None:
    pool = pool_of(name, 3)
    pool.take([1])  # held for the whole test
    for key in range(10, 40):
        pool.take([key])
        pool.give_back([key])
        assert pool.is_cached(1)
        pool.verify()


@pytest.mark.parametrize("name", policy_names())
def test_shared_block_stays_pinned_until_its_last_user_releases_it(name) -> None:
    pool = pool_of(name, 2)
    pool.take([1])
    pool.take([1])
    pool.give_back([1])
    assert pool.is_pinned(1)
    pool.give_back([1])
    assert not pool.is_pinned(1) and pool.is_cached(1)
    pool.verify()


@pytest.mark.parametrize("name", policy_names())
def test_miss_with_every_block_pinned_raises_and_changes_nothing(name) -> None:
    pool = pool_of(name, 2)
    pool.take([1, 2])
    before = (pool.num_cached, pool.num_pinned, pool.policy.list_sizes())
    with pytest.raises(PoolExhausted, match="2 of 2 blocks are pinned"):
        pool.take([3])
    assert (pool.num_cached, pool.num_pinned, pool.policy.list_sizes()) == before
    pool.verify()


def test_remove_refuses_a_pinned_block() -> None:
    pool = pool_of("arc", 4)
    pool.take([1, 2])
    with pytest.raises(ValueError, match="a request holds it"):
        pool.remove(1)
    pool.give_back([1, 2])
    pool.remove(1)
    assert not pool.is_cached(1) and pool.num_free == 3
    pool.verify()


def test_blocks_to_pin_counts_what_a_request_would_add() -> None:
    pool = pool_of("lru", 8)
    pool.take([1, 2])
    assert pool.blocks_to_pin([1, 2, 3, 4]) == 2
    assert pool.blocks_to_pin([5]) == 1


def test_a_fully_cached_prompt_takes_its_last_block_after_the_hits() -> None:
    pool = pool_of("lru", 8)
    pool.take([1, 2, 3])
    pool.give_back([1, 2, 3])
    # vLLM computes the last prompt token, so block 3 is cached but not a hit.
    assert pool.take([1, 2, 3], max_hits=2) == 2
    assert all(pool.is_pinned(key) for key in (1, 2, 3))


def observed(pool: BlockPool, universe: range) -> tuple[object, ...]:
    """What a pool and its policy show: residency, order, lists, counters, next victim."""
    policy: EvictionPolicy = pool.policy
    list_of = getattr(policy, "list_of", None)
    return (
        [key for key in universe if pool.is_cached(key)],
        list(policy.resident_keys()),
        policy.list_sizes(),
        dict(policy.counters.evictions),
        dict(policy.counters.ghost_hits),
        [list_of(key) for key in universe] if list_of else [],
        policy.to_evict(),
        pool.evictions,
    )


@pytest.mark.parametrize("name", policy_names())
@pytest.mark.parametrize("seed", range(2))
def test_serve_alone_is_take_then_give_back(name: str, seed: int) -> None:
    # Requests share prefixes (hits), others' blocks past a miss (cached blocks after the
    # prefix), ghosts and evictions; some cap their hits below a fully cached prompt.
    rng = random.Random(seed)
    universe = range(80)
    prefixes = [rng.sample(universe, rng.randrange(1, 8)) for _ in range(6)]
    one_call, two_calls = pool_of(name, 20), pool_of(name, 20)
    for _ in range(600):
        keys = list(dict.fromkeys(rng.choice(prefixes) + rng.sample(universe, rng.randrange(6))))
        max_hits = len(keys) - rng.randrange(2)
        hits = one_call.serve_alone(keys, max_hits)
        assert hits == two_calls.take(keys, max_hits)
        two_calls.give_back(keys)
        assert observed(one_call, universe) == observed(two_calls, universe)
    one_call.verify()
    assert one_call.evictions, "the sequence never evicted"


def test_serve_alone_with_blocks_held_takes_and_gives_back() -> None:
    pool = pool_of("arc", 4)
    pool.take([1])  # held: the request is served by take and give_back
    assert pool.serve_alone([1, 2], 2) == 1
    assert pool.is_pinned(1) and not pool.is_pinned(2)
    pool.verify()


def test_serve_alone_refuses_a_request_larger_than_the_pool() -> None:
    pool = pool_of("arc", 2)
    with pytest.raises(
        PoolExhausted, match="a request of 3 blocks does not fit: 0 of 2 blocks are pinned"
    ):
        pool.serve_alone([1, 2, 3], 3)
    assert pool.num_cached == 0
