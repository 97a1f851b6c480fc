"""LRU's order: least recently released first."""

from __future__ import annotations

from policy_support import access, drain, victims

from arc_evictor.policies import LRU


def test_evicts_in_release_order() -> None:
    assert victims(LRU(3), "abcde") == ["a", "b"]


def test_hit_makes_a_key_most_recent() -> None:
    policy = LRU(3)
    assert victims(policy, "abcad") == ["b"]
    assert drain(policy) == ["c", "a", "d"]


def test_release_time_not_lookup_time_orders_keys() -> None:
    # A finished request releases its blocks tail first, so the head outlives the tail.
    policy = LRU(4)
    for key in "ab":
        access(policy, key)
    policy.unpin("b")
    policy.unpin("a")
    assert drain(policy) == ["b", "a"]


def test_pinned_key_keeps_its_place_out_of_the_order() -> None:
    policy = LRU(3)
    victims(policy, "abc")
    access(policy, "a")
    assert drain(policy) == ["b", "c"]
    policy.unpin("a")
    assert drain(policy) == ["a"]
