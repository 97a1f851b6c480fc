"""SIEVE's order: a FIFO with visited bits and a hand that remembers where it stopped."""

from __future__ import annotations

import pytest
from policy_support import access, victims

from arc_evictor.policies import PolicyError, Sieve


def test_evicts_the_oldest_unvisited_block() -> None:
    assert victims(Sieve(3), "abcd") == ["a"]


def test_visited_block_survives_and_loses_its_bit() -> None:
    policy = Sieve(3)
    assert victims(policy, "abcad") == ["b"]
    assert "a" in policy


def test_hand_resumes_where_it_stopped() -> None:
    # After evicting b the hand rests on c, so e evicts c although a (now unvisited)
    # is older: SIEVE does not restart at the tail.
    assert victims(Sieve(3), "abcade") == ["b", "c"]


def test_hand_wraps_to_the_oldest_after_a_lap_of_visited_blocks() -> None:
    # a and b are both visited: the hand clears both, wraps, and evicts a.
    policy = Sieve(2)
    assert victims(policy, "abbac") == ["a"]
    assert victims(policy, "d") == ["b"]


def test_pinned_block_is_passed_and_keeps_its_bit() -> None:
    policy = Sieve(2)
    victims(policy, "ab")
    access(policy, "a")  # a hit: visited, and held
    assert victims(policy, "c") == ["b"]
    policy.unpin("a")
    # a kept its bit while pinned, so the hand clears it now and evicts c instead.
    assert victims(policy, "d") == ["c"]


def test_evicting_a_block_other_than_the_victim_raises_and_changes_nothing() -> None:
    policy, twin = Sieve(3), Sieve(3)
    victims(policy, "abca")
    victims(twin, "abca")
    with pytest.raises(PolicyError, match="next victim 'b'"):
        policy.evict("c")
    policy.verify()
    assert list(policy.resident_keys()) == ["a", "b", "c"]
    assert victims(policy, "defg") == victims(twin, "defg") == ["b", "c", "d", "e"]


def test_remove_of_the_block_at_the_hand_moves_the_hand_on() -> None:
    policy = Sieve(3)
    victims(policy, "abcad")  # evicts b; the hand rests on c
    policy.remove("c")
    policy.verify()
    # e fills the freed block; f evicts d, at the hand, not a, at the tail.
    assert victims(policy, "ef") == ["d"]
