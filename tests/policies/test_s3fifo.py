"""S3-FIFO's order: small, main and ghost FIFOs as in libCacheSim's S3FIFO.c.

Most tests use 4 blocks with a half-size small FIFO (small 2, main 2, ghost 3) so the
queues are short enough to follow by hand.
"""

from __future__ import annotations

import pytest
from policy_support import access, run_plain, victims

from arc_evictor.policies import S3FIFO, PolicyError


def small_s3fifo() -> S3FIFO:
    return S3FIFO(4, small_ratio=0.5)


def test_before_the_first_eviction_a_full_small_fifo_sends_blocks_to_main() -> None:
    policy = small_s3fifo()
    run_plain(policy, "abcd")
    assert policy.list_sizes() == {"small": 2, "main": 2, "ghost": 0}


def test_small_block_without_enough_hits_is_evicted_into_the_ghost() -> None:
    policy = small_s3fifo()
    assert victims(policy, "abacde") == ["a"]  # one hit is below the threshold of 2
    assert policy.list_sizes() == {"small": 2, "main": 2, "ghost": 1}
    assert policy.counters.evictions == {"small": 1}


def test_small_block_hit_twice_moves_to_main() -> None:
    policy = small_s3fifo()
    assert victims(policy, "abaacde") == ["b"]
    assert policy.list_sizes() == {"small": 1, "main": 3, "ghost": 1}


def test_ghost_hit_inserts_into_main() -> None:
    policy = small_s3fifo()
    assert victims(policy, "abcdea") == ["a", "b"]
    assert policy.list_sizes() == {"small": 1, "main": 3, "ghost": 1}
    assert policy.counters.ghost_hits == {"ghost": 1}


def test_main_over_its_share_requeues_hit_blocks_and_evicts_without_ghost() -> None:
    # c was hit once in main: the clock re-queues it (counter 1 -> 0) and evicts d.
    policy = small_s3fifo()
    assert victims(policy, "abcdcea") == ["a", "b"]
    assert victims(policy, "f") == ["d"]
    assert policy.counters.evictions == {"small": 2, "main": 1}
    # a's ghost entry went with its ghost hit, and d left no ghost: only b remains.
    assert policy.list_sizes() == {"small": 2, "main": 2, "ghost": 1}


def test_pinned_small_block_is_passed_and_keeps_its_counter() -> None:
    policy = small_s3fifo()
    run_plain(policy, "abcd")
    access(policy, "a")  # a hit (counter 1), held
    assert victims(policy, "e") == ["b"]
    policy.unpin("a")
    # The second hit reaches the threshold: a moves to main and e is evicted.
    assert victims(policy, "af") == ["e"]
    assert policy.list_sizes() == {"small": 1, "main": 3, "ghost": 2}


def test_small_fifo_of_pinned_blocks_falls_back_to_main() -> None:
    policy = small_s3fifo()
    run_plain(policy, "abcd")
    access(policy, "a")
    access(policy, "b")
    assert victims(policy, "e") == ["c"]
    assert policy.counters.evictions == {"main": 1}


def test_evicting_a_block_other_than_the_victim_raises_and_changes_nothing() -> None:
    policy, twin = small_s3fifo(), small_s3fifo()
    run_plain(policy, "abcdb")
    run_plain(twin, "abcdb")
    with pytest.raises(PolicyError, match="next victim 'a'"):
        policy.evict("b")
    policy.verify()
    assert list(policy.resident_keys()) == ["a", "b", "c", "d"]
    assert victims(policy, "efgh") == victims(twin, "efgh")


def test_describe_names_the_small_ratio_and_threshold() -> None:
    assert S3FIFO(100).describe() == "s3fifo-0.10-2"
    assert S3FIFO(100, small_ratio=0.25, move_to_main_threshold=1).describe() == "s3fifo-0.25-1"


def test_cache_under_ten_blocks_still_caches() -> None:
    # libCacheSim admits nothing here; a block pool must cache every block it fills.
    policy = S3FIFO(5)
    assert run_plain(policy, "abcabcabc", verify=True) == 6


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"small_ratio": 0.0}, "small_ratio must be in"),
        ({"small_ratio": 1.0}, "small_ratio must be in"),
        ({"ghost_ratio": -0.5}, "ghost_ratio must be at least 0"),
        ({"move_to_main_threshold": 0}, "move_to_main_threshold must be at least 1"),
        ({"move_to_main_threshold": 1.5}, "move_to_main_threshold must be an integer"),
    ],
)
def test_bad_parameters_are_rejected(params: dict[str, float], problem: str) -> None:
    with pytest.raises(PolicyError, match=problem):
        S3FIFO(100, **params)
