"""ARC's and DBL's order: the paper's rules, including pinning (docs/architecture.md)."""

from __future__ import annotations

from policy_support import access, drain, run_plain, victims, zipf_keys

from arc_evictor.policies import ARC, DBL
from arc_evictor.policies.arc import GhostList

# c = 5: five keys seen twice fill T2, then 6, 7, 8 each seen twice push 1, 2, 3 to B2,
# 9 pushes 4 to B2, and 10 and 11 push 9 and 10 to B1 (the 2c bound drops 1 from B2).
B1_TWO_B2_THREE = [*"12345" * 2, *"667788", "9", "10", "11"]


def test_first_access_goes_to_t1_and_a_hit_moves_it_to_t2() -> None:
    policy = ARC(4)
    run_plain(policy, "ab")
    assert policy.list_sizes() == {"t1": 2, "t2": 0, "b1": 0, "b2": 0}
    run_plain(policy, "a")
    assert policy.list_sizes() == {"t1": 1, "t2": 1, "b1": 0, "b2": 0}


def test_setup_leaves_two_b1_and_three_b2_ghosts() -> None:
    policy = ARC(5)
    assert victims(policy, B1_TWO_B2_THREE) == ["1", "2", "3", "4", "9", "10"]
    assert policy.list_sizes() == {"t1": 1, "t2": 4, "b1": 2, "b2": 3}
    assert policy.target == 0.0


def test_b1_ghost_hit_raises_p_by_b2_over_b1_as_a_float() -> None:
    policy = ARC(5)
    run_plain(policy, B1_TWO_B2_THREE)
    evicted = victims(policy, ["9"])
    assert policy.target == 1.5  # max(1, |B2| / |B1|) = 3 / 2
    # |T1| = 1 is not above p, so REPLACE takes T2's LRU; the ghost comes back into T2.
    assert evicted == ["5"]
    assert policy.list_sizes() == {"t1": 1, "t2": 4, "b1": 1, "b2": 4}
    assert policy.counters.ghost_hits == {"b1": 1}


def test_b2_ghost_hit_lowers_p_by_at_least_one_and_not_below_zero() -> None:
    policy = ARC(5)
    run_plain(policy, [*B1_TWO_B2_THREE, "9"])
    run_plain(policy, ["2"])  # B2 hit: |B1| / |B2| = 1 / 4, so the step is 1
    assert policy.target == 0.5
    assert policy.counters.ghost_hits == {"b1": 1, "b2": 1}
    run_plain(policy, ["3"])
    assert policy.target == 0.0


def test_replace_takes_t1_when_the_key_is_in_b2_and_t1_equals_p() -> None:
    # c = 3: d pushes b to B1; b and c come back from B1 (p 0 -> 1 -> 2), pushing c to B1
    # and a to B2; a's B2 hit lowers p to 1 = |T1|, so REPLACE takes T1's d, not T2's b.
    policy = ARC(3)
    assert victims(policy, "aabcdbc") == ["b", "c", "a"]
    assert policy.target == 2.0
    assert victims(policy, "a") == ["d"]
    assert policy.target == 1.0
    assert policy.list_sizes() == {"t1": 0, "t2": 3, "b1": 1, "b2": 0}


def test_pinned_t1_falls_back_to_t2_and_leaves_p() -> None:
    policy = ARC(3)
    run_plain(policy, "bb")  # b in T2
    access(policy, "a")
    access(policy, "c")  # T1 = a, c, both pinned
    assert victims(policy, "d") == ["b"]  # REPLACE picks T1 (|T1| = 2 > p = 0)
    assert policy.target == 0.0
    assert policy.list_sizes() == {"t1": 3, "t2": 0, "b1": 0, "b2": 1}
    assert policy.counters.evictions == {"t2": 1}


def test_pinned_t2_falls_back_to_t1_and_leaves_p() -> None:
    policy = DBL(4)  # p = 2
    run_plain(policy, "c")  # c in T1
    for key in "ab":
        access(policy, key)
        policy.unpin(key)
        access(policy, key)  # a, b in T2, both pinned
    run_plain(policy, "d")
    # |T1| = 2 is not above p = 2, so REPLACE picks T2, whose blocks are all pinned.
    assert victims(policy, "e") == ["c"]
    assert policy.target == 2.0


def test_dbl_keeps_p_at_half_the_cache_on_ghost_hits() -> None:
    policy = DBL(5)
    for key in zipf_keys(2000, 0.8, 40, seed=11):
        run_plain(policy, [key])
        assert policy.target == 2.5
    assert policy.counters.ghost_hits["b1"] > 0
    assert policy.counters.ghost_hits["b2"] > 0
    assert policy.describe() == "dbl"


def test_released_t2_keys_leave_in_release_order() -> None:
    policy = ARC(4)
    run_plain(policy, "abab")
    assert drain(policy) == ["a", "b"]


def test_least_recently_released_is_the_older_head_of_t1_and_t2() -> None:
    policy = ARC(4)
    run_plain(policy, "aab")  # a in T2, then b in T1: a was released first
    assert policy.list_of("a") == "t2" and policy.list_of("b") == "t1"
    assert policy.least_recently_released() == "a"
    assert policy.to_evict() == "b"  # ARC's own choice: T1 is above p = 0
    run_plain(policy, "a")
    assert policy.least_recently_released() == "b"
    access(policy, "b")  # pinned: only T2 is left
    assert policy.least_recently_released() == "a"


def test_reload_places_keys_and_keeps_ghosts_within_the_case_iv_bounds() -> None:
    policy = ARC(4)
    run_plain(policy, "wxyz")
    newest_first = [(key, key in "eijk") for key in "defghijk"]
    policy.reload([("a", False), ("b", True)], [("c", True)], newest_first, 1.5)
    policy.verify()
    # |T1| + |B1| <= 4 skips h (a fourth B1 ghost); the directory's 8 keys end at i.
    lists = {key: policy.list_of(key) for key in "abcdefghijkw"}
    assert lists == {
        **dict(a="t1", b="t2", c="t2", d="b1", e="b2", f="b1", g="b1", i="b2"),
        **dict.fromkeys("hjkw"),
    }
    assert policy.list_sizes() == {"t1": 1, "t2": 2, "b1": 3, "b2": 2}
    assert policy.target == 1.5
    assert list(policy.resident_keys()) == ["a", "b", "c"]
    assert policy.to_evict() == "b"  # |T1| = 1 is below p: T2's unpinned LRU
    # B1 keeps the newest ghost last: a fresh miss drops g, the oldest, first.
    policy.unpin("c")
    run_plain(policy, ["l"])
    assert policy.list_of("g") is None and policy.list_of("d") == "b1"


def test_a_ghost_removed_and_evicted_again_leaves_in_its_new_turn() -> None:
    ghosts = GhostList()
    for key in "abc":
        ghosts.append(key)
    ghosts.remove("b")  # a ghost hit
    ghosts.append("b")  # evicted again: now the newest
    ghosts.remove("a")
    ghosts.verify()
    assert (len(ghosts), list(ghosts)) == (2, ["c", "b"])
    assert [ghosts.pop_oldest(), ghosts.pop_oldest()] == ["c", "b"]
    assert len(ghosts) == 0


def test_ghost_queue_of_mostly_removed_keys_is_compacted() -> None:
    ghosts = GhostList()
    for key in range(200):
        ghosts.append(key)
    for key in range(190):
        ghosts.remove(key)
    ghosts.verify()  # the queue holds at most 2 x 10 + COMPACT_SLACK entries
    assert list(ghosts) == list(range(190, 200))
    assert ghosts.pop_oldest() == 190


def test_ghost_queue_cuts_off_what_it_has_popped() -> None:
    ghosts = GhostList()
    for key in range(1_000):
        ghosts.append(key)
    popped = [ghosts.pop_oldest() for _ in range(900)]
    ghosts.verify()  # the popped prefix is at most COMPACT_SLACK or the entries left
    assert popped == list(range(900))
    assert list(ghosts) == list(range(900, 1_000))
    ghosts.append(1_000)
    assert [ghosts.pop_oldest() for _ in range(101)] == list(range(900, 1_001))
    ghosts.verify()
