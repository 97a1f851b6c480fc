"""GARC's order: ARC's victims while ARC's miniature leads, release order once LRU's leads."""

from __future__ import annotations

import pytest
from policy_support import access, run_plain, scan_mixed_keys, victims

from arc_evictor.policies import ARC, GARC, LRU, PolicyError

CAPACITY = 8


def lru_leaning_keys(gap: int = 3, fresh: int = 400) -> list[int]:
    """Eight keys made frequent, then fresh keys each reused ``gap`` keys later: LRU hits a
    few more of them than ARC, whose T2 still holds the stale frequent keys."""
    keys = list(range(CAPACITY)) * 3
    for index in range(fresh):
        keys.append(100 + index)
        if index >= gap:
            keys.append(100 + index - gap)
    return keys


def test_victims_are_arcs_while_arc_leads() -> None:
    keys = scan_mixed_keys(3_000, 1.0, 200, seed=1, every=300, scan=100)
    policy = GARC(CAPACITY)
    assert victims(policy, keys) == victims(ARC(CAPACITY), keys)
    assert not policy.follows_lru


def test_switches_to_release_order_when_lru_hits_more() -> None:
    keys = lru_leaning_keys()
    assert run_plain(LRU(CAPACITY), keys) > run_plain(ARC(CAPACITY), keys)
    policy = GARC(CAPACITY)
    run_plain(policy, keys, verify=True)
    assert policy.follows_lru
    oldest = next(iter(policy.resident_keys()))
    assert policy.to_evict() == oldest


def test_release_order_victim_becomes_an_arc_ghost() -> None:
    policy = GARC(CAPACITY)
    run_plain(policy, lru_leaning_keys(), verify=True)
    ghosts = policy.list_sizes()["b1"] + policy.list_sizes()["b2"]
    victim = policy.to_evict()
    policy.evict(victim)
    policy.verify()
    assert victim not in policy
    assert policy.list_sizes()["b1"] + policy.list_sizes()["b2"] == ghosts + 1
    assert not policy.find(victim)
    assert policy.counters.ghost_hits  # the ghost hit counted, as in ARC


def test_pinned_oldest_key_is_skipped_in_release_order() -> None:
    policy = GARC(CAPACITY)
    run_plain(policy, lru_leaning_keys(), verify=True)
    oldest, second = list(policy.resident_keys())[:2]
    access(policy, oldest)
    assert policy.to_evict() == second


def test_large_caches_sample_one_key_in_eight() -> None:
    assert GARC(100_000).describe() == "garc-1/8"
    assert GARC(1_024).describe() == "garc-1/1"
    sampled = sum(GARC(100_000)._sampled(key) for key in range(80_000))
    assert 9_000 < sampled < 11_000


def test_bad_sample_bits_are_rejected() -> None:
    with pytest.raises(PolicyError, match="sample_bits must be in"):
        GARC(4, sample_bits=40)
