"""Small builders shared by the policy tests: the plain-sequence driver and key sequences.

The driver is the block pool's contract (arc_evictor/policies/base.py) reduced to one
block per request with no overlap: every access pins the key and releases it at once.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

from arc_evictor.policies import EvictionPolicy, Key


def access(policy: EvictionPolicy, key: Key, evicted: list[Key] | None = None) -> bool:
    """One pool access of ``key`` (left pinned): True on a hit. Evicts while the pool is
    full, appending each victim to ``evicted`` when given."""
    if policy.find(key):
        policy.pin(key)
        return True
    while len(policy) >= policy.capacity:
        victim = policy.to_evict()
        assert victim is not None, "pool full of pinned blocks"
        policy.evict(victim)
        if evicted is not None:
            evicted.append(victim)
    policy.insert(key)
    return False


def run_plain(
    policy: EvictionPolicy,
    keys: Iterable[Key],
    *,
    verify: bool = False,
    evicted: list[Key] | None = None,
) -> int:
    """Access then release each key in turn; the number of hits."""
    hits = 0
    for key in keys:
        hits += access(policy, key, evicted)
        policy.unpin(key)
        if verify:
            policy.verify()
    return hits


def uniform_keys(n: int, universe: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(universe) for _ in range(n)]


def zipf_keys(n: int, alpha: float, universe: int, seed: int) -> list[int]:
    """Zipf(alpha) over ``universe`` keys; popularity rank is shuffled over the ids."""
    rng = random.Random(seed)
    ids = list(range(universe))
    rng.shuffle(ids)
    cum_weights = list(itertools.accumulate(1.0 / rank**alpha for rank in range(1, universe + 1)))
    return rng.choices(ids, cum_weights=cum_weights, k=n)


def scan_mixed_keys(
    n: int, alpha: float, universe: int, seed: int, *, every: int = 2000, scan: int = 1500
) -> list[int]:
    """Zipf traffic with a scan of ``scan`` never-seen keys after every ``every`` accesses."""
    hot = zipf_keys(n, alpha, universe, seed)
    keys: list[int] = []
    fresh = itertools.count(universe)
    for start in range(0, n, every):
        keys.extend(hot[start : start + every])
        keys.extend(itertools.islice(fresh, scan))
    return keys[:n]


def libcachesim_hits(make_cache: Callable[[int], object], capacity: int, keys: list[int]) -> int:
    """Hits of a libCacheSim cache (unit-size objects) on ``keys``."""
    import libcachesim

    cache = make_cache(capacity)
    request = libcachesim.Request()
    request.obj_size = 1
    hits = 0
    for key in keys:
        request.obj_id = key
        hits += cache.get(request)
    return hits


def victims(policy: EvictionPolicy, keys: Iterable[Key]) -> list[Key]:
    """The keys evicted while ``keys`` are accessed and released in turn."""
    evicted: list[Key] = []
    run_plain(policy, keys, verify=True, evicted=evicted)
    return evicted


def drain(policy: EvictionPolicy) -> list[Key]:
    """Evict every unpinned key; the eviction order."""
    order: list[Key] = []
    while (victim := policy.to_evict()) is not None:
        policy.evict(victim)
        policy.verify()
        order.append(victim)
    return order
