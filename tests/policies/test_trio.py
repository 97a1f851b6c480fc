"""trio's order: the victims of whichever miniature (ARC, LRU, LFU) hits most lately."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys

import pytest
from policy_support import access, run_plain, zipf_keys

from arc_evictor.policies import ARC, LRU, PolicyError, Trio, make_policy
from arc_evictor.policies.lfu import LFU
from arc_simulator.pool import BlockPool

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
    assert policy.leader == "arc"
    # The same keys in an ARC of their own, in the same lists, name the same victim.
    arc = ARC(CAPACITY)
    run_plain(arc, keys)
    assert list(arc.resident_keys()) == list(policy.resident_keys())
    victim = policy.to_evict()
    assert victim == arc.to_evict()
    assert victim != next(iter(policy.resident_keys()))  # not merely LRU's oldest


def arc_far_ahead(capacity: int) -> Trio:
    """A trio whose ARC expert leads all along: its score outweighs any window's hits."""
    policy = Trio(capacity)
    policy.judge.credit("arc", 1e12)
    return policy


def test_while_arc_leads_the_cache_is_arcs_block_for_block() -> None:
    # trio counts every access and feeds its judge on the way to ARC's own paths.
    keys = shifting_keys()
    trio_victims: list[int] = []
    arc_victims: list[int] = []
    trio, arc = arc_far_ahead(CAPACITY), ARC(CAPACITY)
    assert run_plain(trio, keys, evicted=trio_victims) == run_plain(arc, keys, evicted=arc_victims)
    assert trio.leader == "arc" and trio_victims == arc_victims
    scores = trio.judge.scores
    assert scores["arc"] > 1_000 * (scores["lru"] + scores["lfu"]) > 0  # ARC led all along
    # The pool's order of calls: a cached block is pinned before ``find`` sees it.
    trio, arc = arc_far_ahead(CAPACITY), ARC(CAPACITY)
    trio_pool, arc_pool = BlockPool(trio), BlockPool(arc)
    for start in range(0, len(keys), 3):
        request = list(dict.fromkeys(keys[start : start + 3]))
        assert trio_pool.take(request) == arc_pool.take(request)
        trio_pool.give_back(request)
        arc_pool.give_back(request)
        assert list(trio.resident_keys()) == list(arc.resident_keys())
        assert trio.list_sizes() == arc.list_sizes() and trio.target == arc.target
    trio.verify()
    assert trio.leader == "arc"
    assert arc.counters.ghost_hits["b1"] and arc.counters.ghost_hits["b2"]


def test_follows_release_order_when_lru_hits_most() -> None:
    keys = lru_leaning_keys()
    assert run_plain(LRU(CAPACITY), keys) > max(
        run_plain(ARC(CAPACITY), keys), run_plain(LFU(CAPACITY), keys)
    )
    policy = Trio(CAPACITY)
    run_plain(policy, keys, verify=True)
    assert policy.leader == "lru"
    assert policy.to_evict() == next(iter(policy.resident_keys()))


def test_follows_counts_when_lfu_hits_most() -> None:
    keys = popular_keys()
    assert run_plain(LFU(CAPACITY), keys) > max(
        run_plain(ARC(CAPACITY), keys), run_plain(LRU(CAPACITY), keys)
    )
    policy = Trio(CAPACITY)
    run_plain(policy, keys, verify=True)
    assert policy.leader == "lfu"
    victim = policy.to_evict()
    counts = {key: policy.count(key) for key in policy.resident_keys()}
    assert counts[victim] == min(counts.values())


def test_beats_arc_and_lru_on_popular_keys() -> None:
    keys = popular_keys()
    best = max(run_plain(ARC(CAPACITY), keys), run_plain(LRU(CAPACITY), keys))
    assert run_plain(Trio(CAPACITY), keys) > best


def test_lfu_lead_sets_arcs_lists_aside() -> None:
    policy = Trio(CAPACITY)
    run_plain(policy, popular_keys(), verify=True)
    assert policy.leader == "lfu"
    sizes = policy.list_sizes()
    assert sizes["t1"] + sizes["t2"] == CAPACITY and sizes["b1"] == sizes["b2"] == 0
    evictions = sum(policy.counters.evictions.values())
    victim = policy.to_evict()
    policy.evict(victim)
    policy.verify()
    assert victim not in policy and policy.count(victim) > 0
    assert policy.list_of(victim) is None  # no ghost while LFU leads
    assert sum(policy.counters.evictions.values()) == evictions + 1


def lists(policy: Trio, universe: int) -> dict[str, set[int]]:
    """The keys below ``universe`` by the ARC list that holds them."""
    by_list: dict[str, set[int]] = {"t1": set(), "t2": set(), "b1": set(), "b2": set()}
    for key in range(universe):
        list_name = policy.list_of(key)
        if list_name is not None:
            by_list[list_name].add(key)
    return by_list


def test_arc_is_rebuilt_when_lfu_loses_the_lead() -> None:
    policy = Trio(CAPACITY)
    run_plain(policy, popular_keys(), verify=True)
    assert policy.leader == "lfu"
    before, released = lists(policy, 300), list(policy.resident_keys())
    assert before["t2"] and not before["b1"] and not before["b2"]
    mini_arc = policy.judge.miniature("arc")
    policy.judge.credit("arc", 1e9)  # ARC far ahead at this window's end
    policy.judge.end_window()
    policy.follow(policy.judge.leader)
    policy.verify()
    assert policy.leader == "arc"
    after = lists(policy, 300)
    assert after["t2"] == before["t2"] and after["t1"] == set(released) - before["t2"]
    assert list(policy.resident_keys()) == released
    assert policy.target == pytest.approx(mini_arc.target * CAPACITY / mini_arc.capacity)
    # Ghosts: remembered counts of evicted keys, used once in B1, more often in B2.
    assert len(after["b1"]) + len(after["b2"]) > 0
    assert all(policy.count(key) == 1 for key in after["b1"])
    assert all(policy.count(key) > 1 for key in after["b2"])
    assert not (after["b1"] | after["b2"]) & set(released)
    assert policy.list_sizes() == {name: len(keys) for name, keys in after.items()}


def test_switches_keep_every_invariant() -> None:
    policy = Trio(CAPACITY)
    experts = []
    for key in popular_keys() + shifting_keys():
        access(policy, key)
        policy.unpin(key)
        policy.verify()
        assert policy.leader == policy.judge.leader
        if not experts or experts[-1] != policy.leader:
            experts.append(policy.leader)
    assert experts == ["arc", "lfu", "arc"]


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
    counted = max(policy.resident_keys(), key=policy.count)
    assert policy.leader == "lfu" and policy.count(counted) > 1
    policy.clear()
    policy.verify()
    assert policy.leader == "arc" and len(policy) == 0
    assert policy.count(counted) == 0
    assert set(policy.judge.scores.values()) == {0.0} and policy.judge.window_count == 0


@pytest.mark.parametrize(
    ("capacity", "share"), [(1_024, 1), (2_047, 1), (2_048, 2), (13_072, 8), (100_000, 64)]
)
def test_miniatures_keep_at_least_1024_blocks(capacity: int, share: int) -> None:
    policy = Trio(capacity)
    assert policy.describe() == f"trio-1/{share}"
    assert capacity // share >= 1_024
    assert policy.judge.miniature("lfu").capacity == capacity // share
    sampled = sum(policy.judge.sampled(key) for key in range(64_000))
    assert 0.9 * 64_000 / share < sampled < 1.1 * 64_000 / share


@pytest.mark.parametrize("hash_seed", ["1", "2"])
def test_bytes_keys_are_sampled_alike_in_every_process(hash_seed: str) -> None:
    """The plugin's keys are bytes, whose ``hash`` changes with PYTHONHASHSEED: every
    replica and restart must still sample the same keys."""
    script = (
        "import hashlib\n"
        "from arc_evictor.policies import make_policy\n"
        "judge = make_policy('trio', 100_000).judge\n"
        "keys = [hashlib.sha256(str(i).encode()).digest() for i in range(20_000)]\n"
        "print([i for i, key in enumerate(keys) if judge.sampled(key)])\n"
    )
    env = os.environ | {"PYTHONHASHSEED": hash_seed}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    judge = Trio(100_000).judge
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(20_000)]
    expected = [i for i, key in enumerate(keys) if judge.sampled(key)]
    assert run.stdout.strip() == str(expected)
    assert 200 < len(expected) < 450  # about 1 in 64


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_miniature_blocks": 0}, "min_miniature_blocks must be >= 1"),
        ({"history_factor": -1}, "history_factor"),
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        Trio(4, **kwargs)


def test_registry_name_trio_builds_the_follower() -> None:
    policy = make_policy("trio", 4)
    assert type(policy) is Trio and policy.name == "trio"
    with pytest.raises(PolicyError, match="unknown expert 'mru'"):
        policy.follow("mru")
