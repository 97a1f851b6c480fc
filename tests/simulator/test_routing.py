"""Routers and the fleet simulation: the rules, what routers may know, one replica."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.cli import main
from arc_simulator.fleet import _View, simulate_fleet
from arc_simulator.routing import (
    CacheAwareConfig,
    CacheAwareRouter,
    ConsistentHashRouter,
    KvAwareRouter,
    RandomRouter,
    RoundRobinRouter,
    RoutingError,
    make_router,
    router_names,
)
from arc_simulator.simulate import simulate

SIMULATE = (sys.executable, "-m", "arc_simulator.cli", "simulate", str(MOONCAKE_SAMPLE))


@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    return load_trace(MOONCAKE_SAMPLE)[:800]


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> list[TraceRequest]:
    path = tmp_path_factory.mktemp("routing") / "chat.jsonl"
    assert main(["generate", "conversation", "--out", str(path), "--sessions", "60"]) == 0
    return load_trace(path)


def _distinct(requests: Sequence[TraceRequest]) -> int:
    return len({key for request in requests for key in request.keys})


def _core(result) -> dict:
    row = result.as_dict()
    for volatile in ("seconds", "router"):
        row.pop(volatile)
    return row


class StubView:
    """A fleet view with given loads and cached prefixes."""

    def __init__(self, loads: list[int], cached: list[int] | None = None) -> None:
        self.now = 0.0
        self.loads = loads
        self._cached = cached or [0] * len(loads)

    def cached_prefix(self, replica: int, keys: Sequence[int]) -> int:
        return min(self._cached[replica], len(keys))


class NoCacheView(StubView):
    def cached_prefix(self, replica: int, keys: Sequence[int]) -> int:
        raise AssertionError("this router must not read a replica's cache")


def _request(keys: Sequence[int], **fields) -> TraceRequest:
    base = {
        "index": 0,
        "line": 1,
        "timestamp_s": 0.0,
        "input_length": 16 * len(keys) + 1,
        "output_length": 1,
        "hash_ids": (*keys, 999),
        "keys": tuple(keys),
        "block_tokens": 16,
    }
    return TraceRequest(**{**base, **fields})


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("policy", ["lru", "arc", "belady"])
def test_one_replica_gives_the_single_replica_results_for_every_router(
    mooncake, chat, policy, sequential
) -> None:
    for requests in (mooncake, chat):
        capacity = max(1, _distinct(requests) // 10)
        alone = simulate(requests, policy, capacity, sequential=sequential)
        for router in router_names():
            fleet, decisions = simulate_fleet(
                requests, policy, capacity, 1, router, sequential=sequential
            )
            assert _core(fleet) == _core(alone), router
            assert set(decisions) == {0}


def _changed_after(requests: list[TraceRequest], keep: int) -> list[TraceRequest]:
    """The same trace with every request after the first ``keep`` different."""
    donors = list(reversed(requests[keep:]))
    return requests[:keep] + [
        dataclasses.replace(
            request,
            keys=donor.keys,
            hash_ids=donor.hash_ids,
            input_length=donor.input_length,
            output_length=donor.output_length + 7,
        )
        for request, donor in zip(requests[keep:], donors, strict=True)
    ]


@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("router", router_names())
def test_a_router_decides_from_the_past_only(chat, mooncake, router, sequential) -> None:
    for requests in (chat, mooncake):
        keep = len(requests) // 2
        changed = _changed_after(requests, keep)
        capacity = max(1, _distinct(requests) // 20)
        _, decisions = simulate_fleet(requests, "arc", capacity, 4, router, sequential=sequential)
        _, changed_decisions = simulate_fleet(
            changed, "arc", capacity, 4, router, sequential=sequential
        )
        assert decisions[:keep] == changed_decisions[:keep]


def test_kv_aware_sees_the_change_it_is_meant_to(chat) -> None:
    """The previous test is not vacuous: kv_aware's later decisions follow the caches."""
    keep = len(chat) // 2
    capacity = max(1, _distinct(chat) // 20)
    _, decisions = simulate_fleet(chat, "arc", capacity, 4, "kv_aware")
    _, changed = simulate_fleet(_changed_after(chat, keep), "arc", capacity, 4, "kv_aware")
    assert decisions[keep:] != changed[keep:]


@pytest.mark.parametrize("router", ["random", "round_robin", "consistent_hash", "cache_aware"])
@pytest.mark.parametrize("sequential", [True, False])
def test_only_kv_aware_reads_the_replicas_caches(monkeypatch, chat, router, sequential) -> None:
    def forbidden(self, replica, keys):
        raise AssertionError(f"{router} read replica {replica}'s cache")

    monkeypatch.setattr(_View, "cached_prefix", forbidden)
    result, _ = simulate_fleet(chat, "lru", 200, 4, router, sequential=sequential)
    assert result.requests == len(chat)
    with pytest.raises(AssertionError, match="read replica"):
        simulate_fleet(chat, "lru", 200, 4, "kv_aware", sequential=sequential)


def test_round_robin_and_random_rules() -> None:
    request = _request([1, 2])
    view = StubView([0, 0, 0])
    robin = RoundRobinRouter(3)
    assert [robin.route(request, view) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    draws = RandomRouter(3, seed=5)
    again = RandomRouter(3, seed=5)
    sequence = [draws.route(request, view) for _ in range(60)]
    assert sequence == [again.route(request, view) for _ in range(60)]
    assert set(sequence) == {0, 1, 2}


def test_consistent_hash_keeps_a_conversation_on_one_replica() -> None:
    router = ConsistentHashRouter(8)
    view = StubView([0] * 8)
    assert len(router._points) == 8 * ConsistentHashRouter.VIRTUAL_NODES
    placed = {}
    for root in range(200):
        turn1 = _request([root], chat_id=10_000 + root)
        turn2 = _request([root, 1], chat_id=20_000 + root, parent_id=10_000 + root)
        turn3 = _request([root, 1, 2], chat_id=30_000 + root, parent_id=20_000 + root)
        replicas = {router.route(turn, view) for turn in (turn1, turn2, turn3)}
        assert len(replicas) == 1
        placed[root] = replicas.pop()
    assert len(set(placed.values())) == 8  # 200 sessions reach every replica
    # Mooncake form: the first hash id is the key.
    assert router.route(_request([7, 8]), view) == router.route(_request([7, 9, 10]), view)


def test_cache_aware_follows_its_tree_until_the_fleet_is_imbalanced() -> None:
    config = CacheAwareConfig()
    router = CacheAwareRouter(3, config=config)
    balanced = NoCacheView([0, 0, 0])
    assert router.route(_request([1, 2, 3, 4]), balanced) == 0  # no match: least load, first
    balanced.loads = [5, 0, 3]
    assert router.route(_request([1, 2, 3, 9]), balanced) == 0  # 3 of 4 matched > 0.3
    assert router.route(_request([1, 7, 8, 9]), balanced) == 1  # 1 of 4 = 0.25: least load
    assert router.route(_request([1, 7, 8, 5]), balanced) == 1  # now replica 1 owns 1-7-8
    skewed = NoCacheView([config.balance_abs_threshold + 10, 0, 3])
    skewed.now = 1.0
    assert router.route(_request([1, 2, 3, 4]), skewed) == 1  # imbalanced: least load
    # The tree learned the imbalanced choice too: replica 1 reached 1-2-3-4 last.
    later = NoCacheView([0, 0, 0])
    later.now = 2.0
    assert router.route(_request([1, 2, 3, 4]), later) == 1


def test_cache_aware_cuts_each_replicas_tree_back_to_its_cap() -> None:
    config = CacheAwareConfig(eviction_interval_s=10.0, max_tree_tokens=16 * 3)
    router = CacheAwareRouter(2, config=config)
    view = NoCacheView([0, 0])
    router.route(_request([1, 2, 3, 4, 5]), view)
    assert router._tokens[0] == 16 * 5
    view.now = 10.0
    router.route(_request([9]), view)  # the eviction runs before this request
    assert router._tokens[0] == 16 * 3 + 16
    assert 1 in router._owners and 4 not in router._owners


def test_kv_aware_takes_the_longest_cached_prefix_else_the_least_load() -> None:
    router = KvAwareRouter(4)
    request = _request([1, 2, 3, 4])
    assert router.route(request, StubView([0, 0, 0, 0], cached=[1, 3, 2, 0])) == 1
    assert router.route(request, StubView([0, 0, 0, 0], cached=[3, 3, 2, 0])) == 1  # ties: last
    assert router.route(request, StubView([4, 2, 2, 3], cached=[0, 0, 0, 0])) == 1  # least load
    assert router.route(_request([]), StubView([1, 1, 0, 0])) == 2


def test_fleet_result_reports_shares_and_imbalance(mooncake) -> None:
    result, decisions = simulate_fleet(mooncake, "lru", 2_000, 4, "round_robin", sequential=False)
    assert result.replicas == 4 and result.router == "round_robin"
    assert sum(result.request_shares) == pytest.approx(1.0)
    assert sum(result.prefill_token_shares) == pytest.approx(1.0)
    assert result.request_imbalance == pytest.approx(max(result.request_shares) * 4)
    assert decisions == [i % 4 for i in range(len(mooncake))]
    assert result.ttft_p50_s is not None and result.ttft_p99_s >= result.ttft_p50_s
    row = result.as_dict()
    assert {"replicas", "router", "request_shares", "prefill_imbalance"} <= set(row)


def test_a_fleet_with_more_cache_hits_more(mooncake) -> None:
    capacity = _distinct(mooncake) // 10
    alone = simulate(mooncake, "lru", capacity)
    fleet, _ = simulate_fleet(mooncake, "lru", capacity, 4, "kv_aware")
    assert fleet.block_hit_rate > alone.block_hit_rate


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--replicas", "2", "--router", "nearest"], "unknown router 'nearest'"),
        (["--replicas", "0", "--router", "kv_aware"], "replicas must be between 1"),
        (["--replicas", "5000", "--router", "kv_aware"], "replicas must be between 1"),
        (["--router", "kv_aware"], "--router needs --replicas"),
        (["--replicas", "2"], "--replicas needs --router"),
        (["--replicas", "2", "--router", "kv_aware,"], "an empty name"),
        (["--replicas", "2", "--router", "kv_aware", "--policy", "belady"], "belady"),
    ],
)
def test_bad_fleet_input_exits_2_naming_the_problem(args, problem, tmp_path) -> None:
    plot = tmp_path / "sub" / "plot.png"
    done = subprocess.run(
        [*SIMULATE, *args, "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert problem in done.stderr and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1
    assert not plot.parent.exists()


def test_simulate_prints_fleet_json_rows(tmp_path) -> None:
    done = subprocess.run(
        [
            *SIMULATE,
            *("--policy", "lru,arc", "--capacity", "5%", "--replicas", "2"),
            *("--router", "kv_aware,consistent_hash", "--sequential", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(row["router"], row["policy"]) for row in rows] == [
        ("kv_aware", "lru"),
        ("kv_aware", "arc"),
        ("consistent_hash", "lru"),
        ("consistent_hash", "arc"),
    ]
    for row in rows:
        assert row["replicas"] == 2 and len(row["request_shares"]) == 2
        assert row["request_imbalance"] >= 1.0


def test_make_router_rejects_what_it_cannot_build() -> None:
    with pytest.raises(RoutingError, match="valid routers"):
        make_router("least_cost", 2)
    with pytest.raises(RoutingError, match="between 1 and"):
        make_router("random", 0)
    assert make_router(" KV_Aware ", 3).name == "kv_aware"


def test_table_shows_the_fleet_columns(mooncake, capsys, tmp_path: Path) -> None:
    code = main(
        [
            *("simulate", str(MOONCAKE_SAMPLE), "--policy", "lru", "--capacity", "2%"),
            *("--replicas", "2", "--router", "round_robin", "--sequential"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "2 replicas (capacity per replica)" in out
    assert "round_robin" in out and "req imbal" in out and "prefill imbal" in out


def test_the_routed_bench_compares_eight_replicas_with_one() -> None:
    from arc_dev.bench import bench_routed, bench_trace

    requests = bench_trace("conversation", 5_000)
    rows = bench_routed(requests, 100, repeats=1)
    assert [row["replicas"] for row in rows] == [1, 8]
    assert rows[0]["speed_vs_one"] == 1.0 and rows[1]["speed_vs_one"] > 0
    assert rows[1]["request_imbalance"] >= 1.0
