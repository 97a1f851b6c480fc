"""LFU with remembered counts (trio's frequency expert): its eviction order."""

from __future__ import annotations

import pytest
from policy_support import access, drain, run_plain, zipf_keys

from arc_evictor.policies import EvictionPolicy, PolicyError
from arc_evictor.policies.lfu import LFU, MAX_COUNT


def test_evicts_the_least_used_key_oldest_release_first() -> None:
    policy = LFU(4)
    run_plain(policy, ["a", "b", "c", "d", "a", "c", "a"], verify=True)
    assert drain(policy) == ["b", "d", "c", "a"]


def test_an_evicted_key_comes_back_with_its_count() -> None:
    policy = LFU(2)
    run_plain(policy, ["a", "a", "a", "b", "c"], verify=True)  # "b" (count 1) left for "c"
    run_plain(policy, ["d", "a"], verify=True)
    assert policy._order.count("a") == 4
    run_plain(policy, ["x", "y"], verify=True)  # each newcomer evicts the other, not "a"
    assert "a" in policy


def test_without_history_an_evicted_key_starts_again() -> None:
    policy = LFU(1, history_factor=0)
    run_plain(policy, ["a", "a", "b", "a"], verify=True)
    assert policy._order.count("a") == 1


def test_history_keeps_at_most_its_limit() -> None:
    policy = LFU(2, history_factor=2)
    run_plain(policy, range(50), verify=True)
    assert len(policy._order._history) == 4


def test_counts_stop_at_the_cap() -> None:
    policy = LFU(2)
    run_plain(policy, ["a"] * (MAX_COUNT + 10), verify=True)
    assert policy._order.count("a") == MAX_COUNT


def test_pinned_least_used_key_is_skipped() -> None:
    policy = LFU(3)
    run_plain(policy, ["a", "b", "b"], verify=True)
    access(policy, "a")
    assert policy.to_evict() == "b"


def test_remove_forgets_the_count_and_refuses_a_pinned_key() -> None:
    policy = LFU(3)
    run_plain(policy, ["a", "a", "b"], verify=True)
    policy.remove("a")
    assert policy._order.count("a") == 0
    access(policy, "b")
    with pytest.raises(KeyError):
        policy.remove("b")
    policy.verify()


def test_bad_history_factor_is_rejected() -> None:
    with pytest.raises(PolicyError, match="history factor must be >= 0"):
        LFU(4, history_factor=-1)


def test_access_leaves_what_the_plain_calls_leave() -> None:
    keys = zipf_keys(3_000, 0.9, 60, seed=11)
    short, plain = LFU(8), LFU(8)
    hits = [short.access(key) for key in keys]
    assert hits == [EvictionPolicy.access(plain, key) for key in keys]
    short.verify()
    assert list(short.resident_keys()) == list(plain.resident_keys())
    assert short.counters.evictions == plain.counters.evictions
    assert 0 < sum(hits) < len(keys)
