"""The EvictionPolicy contract, run against every registered policy.

Each policy file (test_lru.py, test_arc.py, ...) adds only tests of its own ordering.
"""

from __future__ import annotations

import random

import pytest
from policy_support import access, run_plain, zipf_keys

from arc_evictor.policies import (
    EvictionPolicy,
    PolicyError,
    ReportsStatistics,
    make_policy,
    policy_names,
)

pytestmark = pytest.mark.parametrize("name", policy_names())


def snapshot(policy: EvictionPolicy) -> tuple[object, ...]:
    """Everything observable about a policy's state."""
    return (
        policy.list_sizes(),
        list(policy.resident_keys()),
        len(policy),
        policy.target,
        dict(policy.counters.evictions),
        dict(policy.counters.ghost_hits),
    )


def warmed(name: str, capacity: int = 8, *, pinned: tuple[int, ...] = ()) -> EvictionPolicy:
    """A policy after a skewed workload with ghost hits, then ``pinned`` keys held."""
    policy = make_policy(name, capacity)
    run_plain(policy, zipf_keys(400, 1.0, 30, seed=7), verify=True)
    for key in pinned:
        access(policy, key)
    policy.verify()
    return policy


def test_new_policy_is_empty(name: str) -> None:
    policy = make_policy(name, 4)
    assert len(policy) == 0
    assert policy.to_evict() is None
    assert list(policy.resident_keys()) == []
    assert set(policy.list_sizes().values()) == {0}
    policy.verify()


def test_registry_builds_the_named_policy(name: str) -> None:
    policy = make_policy(name.upper(), 4)
    assert policy.name == name
    assert policy.capacity == 4
    assert policy.describe().startswith(name)


def test_statistics_are_reported_apart_from_the_eviction_interface(name: str) -> None:
    policy = make_policy(name, 4)
    assert isinstance(policy, ReportsStatistics)
    statistics = {"counters", "list_sizes", "target", "resident_lists", "ghost_lists"}
    assert not statistics & set(dir(EvictionPolicy))
    assert policy.counters.evictions == policy.counters.ghost_hits == {}


def test_list_names_match_declared_lists(name: str) -> None:
    policy = warmed(name)
    sizes = policy.list_sizes()
    assert list(sizes) == [*policy.resident_lists, *policy.ghost_lists]
    assert sum(sizes[list_name] for list_name in policy.resident_lists) == len(policy)


def test_inserted_key_is_resident_and_pinned(name: str) -> None:
    policy = make_policy(name, 4)
    assert not access(policy, "a")
    assert "a" in policy
    assert len(policy) == 1
    assert policy.to_evict() is None


def test_released_key_is_hit_and_evictable(name: str) -> None:
    policy = make_policy(name, 4)
    access(policy, "a")
    policy.unpin("a")
    assert policy.to_evict() == "a"
    assert access(policy, "a")
    assert policy.to_evict() is None


def test_to_evict_never_names_a_pinned_key(name: str) -> None:
    policy = make_policy(name, 4)
    for key in "abcd":
        access(policy, key)
    policy.unpin("c")
    assert policy.to_evict() == "c"


def test_to_evict_changes_nothing(name: str) -> None:
    policy = warmed(name, pinned=(0, 1))
    before = snapshot(policy)
    victims = {policy.to_evict() for _ in range(3)}
    assert snapshot(policy) == before
    assert len(victims) == 1
    policy.verify()


def test_evict_forgets_the_victim(name: str) -> None:
    policy = warmed(name, pinned=(0,))
    victim = policy.to_evict()
    assert victim is not None and victim != 0
    size = len(policy)
    policy.evict(victim)
    policy.verify()
    assert victim not in policy
    assert victim not in set(policy.resident_keys())
    assert len(policy) == size - 1
    assert not policy.find(victim)


def test_evict_counts_one_eviction_on_a_resident_list(name: str) -> None:
    policy = warmed(name)
    before = dict(policy.counters.evictions)
    policy.evict(policy.to_evict())
    after = policy.counters.evictions
    changed = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert list(changed.values()) == [1]
    assert set(changed) <= set(policy.resident_lists)


def test_remove_forgets_the_key(name: str) -> None:
    policy = warmed(name, pinned=(0,))
    key = next(k for k in policy.resident_keys() if k != 0)
    size = len(policy)
    policy.remove(key)
    policy.verify()
    assert key not in policy
    assert len(policy) == size - 1
    assert key not in set(policy.resident_keys())


def test_remove_of_a_pinned_key_raises_and_changes_nothing(name: str) -> None:
    policy = warmed(name, pinned=(0,))
    before = snapshot(policy)
    with pytest.raises((KeyError, PolicyError)):
        policy.remove(0)
    assert snapshot(policy) == before
    policy.verify()


def test_remove_of_a_non_resident_key_raises_and_changes_nothing(name: str) -> None:
    # Keys 0..29 were all accessed; the evicted ones may be ghosts (ARC, DBL, S3-FIFO).
    policy = warmed(name)
    before = snapshot(policy)
    for key in (k for k in range(30) if k not in policy):
        with pytest.raises((KeyError, PolicyError)):
            policy.remove(key)
    assert snapshot(policy) == before
    policy.verify()


def test_unpin_of_an_unknown_key_raises_and_changes_nothing(name: str) -> None:
    policy = warmed(name)
    before = snapshot(policy)
    with pytest.raises((KeyError, PolicyError)):
        policy.unpin("never seen")
    assert snapshot(policy) == before


def test_resident_keys_lists_each_resident_key_once(name: str) -> None:
    policy = warmed(name, pinned=(0, 1))
    keys = list(policy.resident_keys())
    assert len(keys) == len(set(keys)) == len(policy)
    assert all(key in policy for key in keys)


def test_full_pool_of_pinned_keys_has_no_victim(name: str) -> None:
    policy = make_policy(name, 3)
    for key in "abc":
        access(policy, key)
    assert policy.to_evict() is None


def test_pool_never_exceeds_capacity(name: str) -> None:
    policy = make_policy(name, 5)
    run_plain(policy, range(50), verify=True)
    assert len(policy) == 5


def test_capacity_one_caches_the_last_key(name: str) -> None:
    policy = make_policy(name, 1)
    assert run_plain(policy, ["a", "a", "b", "b", "a"], verify=True) == 2
    assert list(policy.resident_keys()) == ["a"]


def test_clear_forgets_every_key_and_history(name: str) -> None:
    policy = warmed(name)
    keys = list(policy.resident_keys())
    evictions = dict(policy.counters.evictions)
    policy.clear()
    policy.verify()
    assert len(policy) == 0
    assert set(policy.list_sizes().values()) == {0}
    assert not any(key in policy for key in keys)
    assert policy.counters.evictions == evictions
    assert run_plain(policy, range(8), verify=True) == 0
    assert len(policy) == 8


def test_access_leaves_what_the_plain_calls_leave(name: str) -> None:
    # ``access`` may take a shorter path than find/pin/insert/unpin, never a different one.
    keys = zipf_keys(3_000, 0.9, 60, seed=11)
    short, plain = make_policy(name, 8), make_policy(name, 8)
    hits = [short.access(key) for key in keys]
    assert hits == [EvictionPolicy.access(plain, key) for key in keys]
    short.verify()
    assert snapshot(short) == snapshot(plain)
    assert 0 < sum(hits) < len(keys)


def test_unknown_policy_name_lists_the_valid_names(name: str) -> None:
    with pytest.raises(PolicyError, match="unknown eviction policy 'belady'") as error:
        make_policy("belady", 4)
    assert name in str(error.value)


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_below_one_is_rejected(name: str, capacity: int) -> None:
    with pytest.raises(PolicyError, match="capacity must be at least 1"):
        make_policy(name, capacity)


def copy_entry(key: object) -> object:
    """A further copy's entry, as the vLLM plugin names one."""
    return ("copy", key)


def test_batched_calls_leave_the_state_of_the_per_key_calls(name: str) -> None:
    batched, single = warmed(name, 16), warmed(name, 16)
    # Misses, keys that may be resident (they get a copy's entry) and a block without a key.
    request = [100, 101, None, 102, 5, 103, 104, 7, 105]

    free = batched.capacity - len(batched)  # blocks that hold no key
    entries, victims = batched.allocate(request, free, copy_entry)
    expected: list[object] = [None] * len(request)
    evicted: list[object] = []
    for index in range(len(request) - 1, -1, -1):
        key = request[index]
        if key is not None:
            key = copy_entry(key) if key in single else key
            single.find(key)
        if free:
            free -= 1
        else:
            evicted.append(single.to_evict())
            single.evict(evicted[-1])
        if key is not None:
            single.insert(key)
            expected[index] = key
    assert (entries, victims) == (expected, evicted)
    assert snapshot(batched) == snapshot(single)

    released = [entry for entry in reversed(entries) if entry is not None]
    batched.release(released)
    for key in released:
        single.unpin(key)
    assert snapshot(batched) == snapshot(single)

    prefix = released[:4]
    batched.touch(prefix, [True, True, True, True])
    for key in prefix:
        single.pin(key)
        single.find(key)
    assert snapshot(batched) == snapshot(single)
    batched.verify()


def deep_snapshot(policy: EvictionPolicy, universe: range) -> tuple[object, ...]:
    """``snapshot``, the next victim and, for a policy with named lists (ARC, trio), the list
    each key of ``universe`` is in, ghost lists included."""
    list_of = getattr(policy, "list_of", None)
    lists = [list_of(key) for key in universe] if list_of else []
    return (*snapshot(policy), lists, policy.to_evict())


@pytest.mark.parametrize("seed", range(3))
def test_batched_calls_equal_the_per_key_calls_over_overlapping_requests(
    name: str, seed: int
) -> None:
    # A pool's life in miniature: requests overlap, share blocks (reference counts above one),
    # hit ghosts, evict, and hold blocks without a key; every batched call must return and
    # leave what the base class's per-key calls do, step by step.
    rng = random.Random(seed)
    universe = range(60)
    batched, single = make_policy(name, 24), make_policy(name, 24)
    refs: dict[object, int] = {}
    running: list[list[object]] = []
    for _ in range(1_500):
        if running and (len(running) > 3 or rng.random() < 0.4):
            held = running.pop(rng.randrange(len(running)))
            released = []
            for key in reversed(held):
                refs[key] -= 1
                if not refs[key]:
                    del refs[key]
                    released.append(key)
            batched.release(released)
            EvictionPolicy.release(single, released)
        else:
            keys = list(dict.fromkeys(rng.choices(universe, [1 / (k + 1) for k in universe], k=8)))
            cached = [key for key in reversed(keys) if key in batched]
            misses: list[object] = [key for key in keys if key not in batched]
            misses += [None] * rng.randrange(2)  # blocks that hold no key
            evictable = len(batched) - len(refs)
            free = batched.capacity - len(batched)
            if len(misses) > free + evictable - sum(refs.get(key, 0) == 0 for key in cached):
                continue  # the pool would refuse it
            newly_pinned = [key not in refs for key in cached]
            for key in cached:
                refs[key] = refs.get(key, 0) + 1
            batched.touch(cached, newly_pinned)
            EvictionPolicy.touch(single, cached, newly_pinned)
            assert deep_snapshot(batched, universe) == deep_snapshot(single, universe)
            free = batched.capacity - len(batched)
            allocated = batched.allocate(misses, free, copy_entry)
            assert allocated == EvictionPolicy.allocate(single, misses, free, copy_entry)
            entries = [entry for entry in allocated[0] if entry is not None]
            for entry in entries:
                refs[entry] = 1
            running.append(cached[::-1] + entries)
        assert deep_snapshot(batched, universe) == deep_snapshot(single, universe)
    batched.verify()
    assert batched.counters.evictions, "the sequence never evicted"
    assert batched.counters.ghost_hits or not batched.ghost_lists, "no ghost was hit"


def test_allocate_with_every_key_pinned_names_the_missing_victim(name: str) -> None:
    policy = make_policy(name, 2)
    policy.allocate([1, 2], 2, copy_entry)  # both inserted, pinned
    with pytest.raises(RuntimeError, match="named no victim with 2 resident keys"):
        policy.allocate([3], 0, copy_entry)
    assert sorted(policy.resident_keys()) == [1, 2]
