"""Trio's order: the victims of whichever miniature (ARC, LRU, LFU) hits most lately."""

from __future__ import annotations

import itertools

import pytest
from policy_support import access, run_plain, zipf_keys

from arc_evictor.policies import ARC, LRU, PolicyError, Trio
from arc_evictor.policies.lfu import LFU

CAPACITY = 8


def lru_leaning_keys(gap: int = 3, fresh: int = 400) -> list[int]:
    """Eight keys made frequent, then fresh keys each reused ``gap`` keys later: LRU hits
    more of them than ARC (whose T2 keeps the stale frequent keys) and LFU."""
    keys = list(range(CAPACITY)) * 3
    for index in range(fresh):
        keys.append(100 + index)
        if index >= gap:
            keys.append(100 + index - gap)
    return keys


def popular_keys() -> list[int]:
    """Zipf traffic over many more keys than the cache: only remembered counts find the
    popular ones, so LFU hits the most."""
    return zipf_keys(3_000, 0.9, 300, seed=3)


def shifting_keys() -> list[int]:
    """Eight phases, each a Zipf law over its own twelve keys, cut by scans of fresh keys:
    scans hurt LRU, stale counts hurt LFU, and ARC hits the most."""
    keys: list[int] = []
    fresh = itertools.count(10_000)
    for phase in range(8):
        hot = [100 * phase + key for key in zipf_keys(400, 1.0, 12, seed=phase)]
        for start in range(0, len(hot), 50):
            keys.extend(hot[start : start + 50])
            keys.extend(itertools.islice(fresh, 12))
    return keys


def test_victims_are_arcs_while_arc_leads() -> None:
    keys = shifting_keys()
    assert run_plain(ARC(CAPACITY), keys) > max(
        run_plain(LRU(CAPACITY), keys), run_plain(LFU(CAPACITY), keys)
    )
    policy = Trio(CAPACITY)
    run_plain(policy, keys, verify=True)
    assert policy.expert == "arc"
    victim = policy.to_evict()
    assert victim == ARC.to_evict(policy)
    assert victim != next(iter(policy.resident_keys()))  # not merely LRU's oldest


def test_follows_release_order_when_lru_hits_most() -> None:
    keys = lru_leaning_keys()
    assert run_plain(LRU(CAPACITY), keys) > max(
        run_plain(ARC(CAPACITY), keys), run_plain(LFU(CAPACITY), keys)
    )
    policy = Trio(CAPACITY)
    run_plain(policy, keys, verify=True)
    assert policy.expert == "lru"
    assert policy.to_evict() == next(iter(policy.resident_keys()))


def test_follows_counts_when_lfu_hits_most() -> None:
    keys = popular_keys()
    assert run_plain(LFU(CAPACITY), keys) > max(
        run_plain(ARC(CAPACITY), keys), run_plain(LRU(CAPACITY), keys)
    )
    policy = Trio(CAPACITY)
    run_plain(policy, keys, verify=True)
    assert policy.expert == "lfu"
    victim = policy.to_evict()
    counts = {key: policy._freq.count(key) for key in policy.resident_keys()}
    assert counts[victim] == min(counts.values())


def test_beats_arc_and_lru_on_popular_keys() -> None:
    keys = popular_keys()
    best = max(run_plain(ARC(CAPACITY), keys), run_plain(LRU(CAPACITY), keys))
    assert run_plain(Trio(CAPACITY), keys) > best


def test_counted_victim_becomes_an_arc_ghost() -> None:
    policy = Trio(CAPACITY)
    run_plain(policy, popular_keys(), verify=True)
    sizes = policy.list_sizes()
    victim = policy.to_evict()
    policy.evict(victim)
    policy.verify()
    assert victim not in policy
    assert policy.list_sizes()["b1"] + policy.list_sizes()["b2"] == sizes["b1"] + sizes["b2"] + 1


def test_pinned_least_counted_key_is_skipped() -> None:
    policy = Trio(CAPACITY)
    run_plain(policy, popular_keys(), verify=True)
    victim = policy.to_evict()
    access(policy, victim)
    policy.verify()
    assert policy.to_evict() not in (victim, None)


def test_clear_forgets_counts_and_returns_to_arc() -> None:
    policy = Trio(CAPACITY)
    run_plain(policy, popular_keys())
    policy.clear()
    policy.verify()
    assert policy.expert == "arc" and len(policy) == 0
    assert policy._freq.count(0) == 0


def test_large_caches_sample_one_key_in_eight() -> None:
    assert Trio(100_000).describe() == "trio-1/8"
    assert Trio(1_024).describe() == "trio-1/1"
    sampled = sum(Trio(100_000)._sampled(key) for key in range(80_000))
    assert 9_000 < sampled < 11_000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"sample_bits": 40}, "sample_bits must be in"), ({"history_factor": -1}, "history_factor")],
)
def test_bad_parameters_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Trio(4, **kwargs)
