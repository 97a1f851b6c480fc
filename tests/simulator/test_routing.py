"""Routers and the fleet simulation: the rules, what routers may know, one replica."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from arc_evictor.policies import make_policy
from arc_serving_common.sessions import session_keys
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.cli import main
from arc_simulator.fleet import _View, simulate_fleet
from arc_simulator.ring_hash import fbi_hash, furc_hash, murmur_hash_64a
from arc_simulator.routing import (
    SESSION_HEADER_KEY,
    WINDOW_PER_REPLICA,
    BoundedPrefixRouter,
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
from arc_simulator.simulate import CostModel, Replica, simulate

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
    """A fleet view with given loads, published prefixes and requests in prefill, over the
    requests of ``trace`` (their session keys, as the client sends them)."""

    def __init__(
        self,
        loads: list[int],
        cached: list[int] | None = None,
        prefilling: list[set[int]] | None = None,
        trace: Sequence[TraceRequest] = (),
    ) -> None:
        self.now = 0.0
        self.loads = loads
        self._cached = cached or [0] * len(loads)
        self.in_prefill = prefilling or [set() for _ in loads]
        indexes = [request.index for request in trace]
        self._sessions = dict(zip(indexes, session_keys(trace), strict=True))

    def session_id(self, request: TraceRequest) -> str:
        return self._sessions[request.index]

    def cached_prefix(self, replica: int, keys: Sequence[int]) -> int:
        return min(self._cached[replica], len(keys))

    def prefilling(self, replica: int) -> set[int]:
        return self.in_prefill[replica]


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
def test_only_the_routers_of_kv_events_read_the_replicas_caches(
    monkeypatch, chat, router, sequential
) -> None:
    def forbidden(self, replica, keys):
        raise AssertionError(f"{router} read replica {replica}'s cache")

    monkeypatch.setattr(_View, "cached_prefix", forbidden)
    result, _ = simulate_fleet(chat, "lru", 200, 4, router, sequential=sequential)
    assert result.requests == len(chat)
    for reader in ("kv_aware", "bounded_prefix"):
        with pytest.raises(AssertionError, match="read replica"):
            simulate_fleet(chat, "lru", 200, 4, reader, sequential=sequential)


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
    assert len(router._points) == 8 * ConsistentHashRouter.VIRTUAL_NODES
    turns = {}
    for root in range(200):
        first, second, third = 3 * root, 3 * root + 1, 3 * root + 2  # trace indexes and chat ids
        turns[root] = [
            _request([root], index=first, chat_id=first),
            _request([root, 1], index=second, chat_id=second, parent_id=first),
            _request([root, 1, 2], index=third, chat_id=third, parent_id=second),
        ]
    trace = [turn for conversation in turns.values() for turn in conversation]
    view = StubView([0] * 8, trace=trace)
    placed = {}
    for root, conversation in turns.items():
        replicas = {router.route(turn, view) for turn in conversation}
        assert len(replicas) == 1
        placed[root] = replicas.pop()
    assert len(set(placed.values())) == 8  # 200 sessions reach every replica
    # Unlinked (Mooncake) form: the key follows each conversation's own chain of blocks, and
    # block 7, which two conversations continue differently, joins neither to the first.
    chain = [[7], [7, 8], [7, 8, 9], [7, 10]]
    trace = [_request(keys, index=n, line=n + 1) for n, keys in enumerate(chain)]
    chains = StubView([0] * 8, trace=trace)
    keys = [chains.session_id(request) for request in trace]
    assert keys == ["line:1", "line:2", "line:2", "line:4"]


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


def test_kv_aware_sends_cold_prompts_to_the_first_registered_replica() -> None:
    router = KvAwareRouter(4)
    view = StubView([0, 0, 0, 0])
    assert [router.route(_request([n, n + 1], index=n), view) for n in range(5)] == [0] * 5
    assert router.route(_request([]), view) == 0  # no full block: nothing to credit
    assert router.route(_request([1, 2]), StubView([1, 0, 0, 0])) == 1  # the first least cost


def test_kv_aware_cost_is_new_plus_in_flight_prefill_times_running_plus_one() -> None:
    router = KvAwareRouter(3)
    request = _request([1, 2, 3, 4])  # 65 tokens
    view = StubView([2, 0, 1], cached=[4, 0, 2])
    # cap 4 blocks: 65 - 64 = 1 new token on replica 0, 65 on 1, 65 - 32 = 33 on 2
    assert router.costs(request, view) == [(1 * 3, 1), (65 * 1, 65), (33 * 2, 33)]
    assert router.route(request, view) == 0
    # Its 1 token is now in flight on replica 0 until the view says its prefill ended.
    view = StubView([2, 0, 1], prefilling=[{request.index}, set(), set()])
    assert router.costs(_request([9], index=1), view)[0] == ((17 + 1) * 3, 17)
    view.in_prefill[0] = set()
    assert router.costs(_request([9], index=1), view)[0] == (17 * 3, 17)


def test_kv_aware_in_flight_prefill_sends_the_next_cold_prompt_elsewhere() -> None:
    router = KvAwareRouter(2)
    view = StubView([0, 0])
    assert router.route(_request([1, 2], index=0), view) == 0
    view.in_prefill[0] = {0}  # prefilling, though not counted as running
    assert router.route(_request([3, 4], index=1), view) == 1
    view.in_prefill = [set(), set()]
    assert router.route(_request([5, 6], index=2), view) == 0


@pytest.mark.parametrize("held, winner", [(3, 0), (4, 0), (5, 1), (7, 1)])
def test_a_busy_holder_beats_an_idle_replica_only_beyond_half_the_prompt(held, winner) -> None:
    # 128 tokens, 8 full blocks of 16: the holder (replica 1, one request running) costs
    # (128 - 16 * held) * 2 against the idle replica's 128, so it wins only when it holds
    # more than 64 tokens; at exactly half the tie goes to the first registered replica.
    request = _request(list(range(1, 9)), input_length=128)
    view = StubView([0, 1], cached=[0, held])
    assert KvAwareRouter(2).route(request, view) == winner


def _fill_window(router: BoundedPrefixRouter, replicas: int) -> None:
    """A full window of cold prompts that open differently, as even as the rule makes them."""
    for index in range(WINDOW_PER_REPLICA * replicas):
        router.route(_request([10_000 + index, 1], index=index), StubView([0] * replicas))


def test_bounded_prefix_follows_the_prefix_while_the_holder_is_under_its_share() -> None:
    router = BoundedPrefixRouter(2, load_bound=0.1)
    _fill_window(router, 2)
    view = StubView([1, 0], cached=[3, 0])  # the holder is busy: kv_aware's load term aside
    chosen = [router.route(_request([1, 2, 3, 4], index=n), view) for n in range(20)]
    # The holder takes them until its share of the last 128 decisions reaches 1.1 / 2 (the
    # window drops the oldest as it goes); then the other replica takes its turns.
    assert chosen[:13] == [0] * 13 and set(chosen[13:]) == {0, 1}


def test_bounded_prefix_keeps_every_replica_within_its_share_of_recent_requests() -> None:
    router = BoundedPrefixRouter(4, load_bound=0.1)
    window = WINDOW_PER_REPLICA * 4
    chosen = [
        router.route(_request([7, 8], index=n), StubView([0] * 4, cached=[2] * 4))
        for n in range(3 * window)
    ]
    for end in range(window, len(chosen)):
        shares = [chosen[end - window : end].count(replica) / window for replica in range(4)]
        assert max(shares) <= 1.1 / 4 + 1 / window
    # Affinity fills the favourite replica up to its bound.
    assert max(chosen[-window:].count(replica) for replica in range(4)) == 71


def test_bounded_prefix_sends_cold_prompts_that_open_alike_to_one_replica() -> None:
    router = BoundedPrefixRouter(8)
    _fill_window(router, 8)
    same_opening = {router.route(_request([5, n], index=n), StubView([0] * 8)) for n in range(6)}
    assert len(same_opening) == 1
    assert router.route(_request([]), StubView([1, 0] + [1] * 6)) == 1  # no block: least load


def test_the_proposal_runs_on_request_and_stays_out_of_the_vllm_router_study() -> None:
    from arc_simulator.scaling import ScaleConfig

    assert "bounded_prefix" in router_names()
    assert "bounded_prefix" not in ScaleConfig().routers
    assert set(ScaleConfig().routers) == set(router_names()) - {"bounded_prefix"}


def test_a_bad_load_bound_is_refused() -> None:
    for bad in (-0.1, math.inf, math.nan):
        with pytest.raises(RoutingError, match="load bound"):
            BoundedPrefixRouter(2, load_bound=bad)


def test_kv_aware_credit_leaves_the_last_prompt_token_to_compute() -> None:
    router = KvAwareRouter(2)
    whole = _request([1, 2, 3], input_length=48)  # three full blocks, all cached on 1
    assert router.costs(whole, StubView([0, 0], cached=[0, 3])) == [(48, 48), (16, 16)]
    one_block = _request([1], input_length=16)  # cap 0: nothing can be credited
    assert router.costs(one_block, StubView([0, 0], cached=[0, 1])) == [(16, 16), (16, 16)]
    assert router.route(one_block, StubView([0, 0], cached=[0, 1])) == 0


def test_kv_aware_temperature_draws_are_seeded_and_weighted() -> None:
    view = StubView([0, 0, 0])

    def draws(seed: int, temperature: float, count: int = 60) -> list[int]:
        router = KvAwareRouter(3, seed=seed, temperature=temperature)
        return [router.route(_request([n + 100], index=n), view) for n in range(count)]

    assert draws(5, 2.0) == draws(5, 2.0)  # equal costs: a seeded uniform draw
    assert draws(5, 2.0) != draws(6, 2.0)
    assert set(draws(5, 2.0)) == {0, 1, 2}
    # Costs 17, 34 and 51 at temperature 17: weights 1, e^-1 and e^-2.
    weighted = KvAwareRouter(3, seed=1, temperature=17.0)
    loaded = StubView([0, 1, 2])
    picks = [weighted.route(_request([n + 100], index=n), loaded) for n in range(3000)]
    shares = [picks.count(replica) / len(picks) for replica in range(3)]
    weights = [1.0, math.exp(-1), math.exp(-2)]
    assert shares == pytest.approx([w / sum(weights) for w in weights], abs=0.03)
    # Far below the cost differences, the draw is the least cost.
    assert {KvAwareRouter(3, seed=3, temperature=0.01).route(_request([1]), loaded)} == {0}


@pytest.mark.parametrize("temperature", [-1.0, math.inf, math.nan])
def test_a_bad_router_temperature_is_refused_naming_the_option(temperature) -> None:
    with pytest.raises(RoutingError, match="--router-temperature must be a finite number >= 0"):
        make_router("kv_aware", 2, temperature=temperature)
    with pytest.raises(RoutingError, match="--router-temperature"):
        KvAwareRouter(2, temperature=temperature)


def test_kv_aware_session_affinity_keeps_a_session_where_it_went_whatever_the_cost() -> None:
    router = KvAwareRouter(2, affinity_ttl_s=30)
    opening = _request([1, 2], index=0, chat_id=7)
    follow_up = _request([1, 2, 3], index=1, chat_id=8, parent_id=7)
    other = _request([1, 2, 3], index=2, chat_id=9)
    late = _request([1, 2, 3, 4], index=3, chat_id=10, parent_id=8)
    trace = [opening, follow_up, other, late]
    view = StubView([0, 0], trace=trace)
    assert router.route(opening, view) == 0  # a session's first request: the cost rule
    # Its next turn goes back to replica 0 though replica 1 holds the whole prompt and is idle.
    view = StubView([5, 0], cached=[0, 3], trace=trace)
    view.now = 29.0
    assert router.route(follow_up, view) == 0
    # Another session takes the cost rule; so does this one after a pause beyond the TTL.
    assert router.route(other, view) == 1
    view.now = 59.5
    assert router.route(late, view) == 1
    # Without the TTL the same follow-up takes the cost rule.
    plain = KvAwareRouter(2)
    assert plain.route(opening, StubView([0, 0], trace=trace)) == 0
    assert plain.route(follow_up, view) == 1


@pytest.mark.parametrize("ttl", [0, -5, 31_536_001, 2.5])
def test_a_bad_session_affinity_ttl_is_refused(ttl) -> None:
    with pytest.raises(RoutingError, match="session affinity TTL must be whole seconds"):
        make_router("kv_aware", 2, affinity_ttl_s=ttl)


def test_kv_aware_credits_blocks_from_the_end_of_the_prefill_that_computed_them() -> None:
    cost = CostModel()
    replica = Replica.of(make_policy("lru", 100), "overlapping", cost, routed=True)
    first = _request([1, 2, 3], index=0, input_length=49, timestamp_s=1.0)
    replica.enqueue(0, first)
    assert replica.prefilling(1.0) == {0}  # queued: its prefill has not ended
    replica.advance(1.0)
    end = 1.0 + cost.step_seconds + 49 * cost.prefill_seconds_per_token
    assert replica.published_prefix(first.keys, 1.0) == 0  # computed, not yet published
    assert replica.prefilling(1.0) == {0}
    assert replica.published_prefix(first.keys, end) == 3
    assert replica.prefilling(end) == set()
    # A later request's new blocks wait for its own prefill; the shared prefix does not.
    second = _request([1, 2, 4], index=1, input_length=49, timestamp_s=2.0)
    replica.enqueue(1, second)
    replica.advance(2.0)
    assert replica.published_prefix(second.keys, 2.0) == 2


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
        (
            ["--replicas", "2", "--router", "kv_aware", "--router-temperature", "-0.5"],
            "--router-temperature must be a finite number >= 0, got -0.5",
        ),
        (["--router-temperature", "1"], "--router-temperature needs --router"),
        (
            ["--replicas", "2", "--router", "kv_aware", "--session-affinity-ttl", "0"],
            "the session affinity TTL must be whole seconds from 1 to 31536000, got 0",
        ),
        (["--session-affinity-ttl", "60"], "--session-affinity-ttl needs --router"),
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


def test_router_temperature_reaches_kv_aware_from_the_command_line(capsys) -> None:
    def run(*extra: str) -> dict:
        args = ["simulate", str(MOONCAKE_SAMPLE), "--policy", "lru", "--capacity", "5%"]
        assert main([*args, "--replicas", "2", "--router", "kv_aware", "--json", *extra]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        row.pop("seconds")
        return row

    drawn = run("--router-temperature", "5000", "--seed", "3")
    assert drawn == run("--router-temperature", "5000", "--seed", "3")  # seeded
    assert drawn != run()  # temperature 0 decides otherwise
    # The sample's requests are unlinked: their sessions follow their chains of blocks.
    assert run("--session-affinity-ttl", "600") != run()


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


def test_the_ring_hash_is_a_64_bit_murmur_over_a_furc_bucket() -> None:
    # MurmurHash64A's tail handling: a key of 9 bytes is one word plus a one-byte tail,
    # and the tail's bytes are little-endian (changing the last byte changes the hash).
    assert murmur_hash_64a(b"abcdefgh1") != murmur_hash_64a(b"abcdefgh2")
    assert 0 <= murmur_hash_64a(b"") < 2**64
    buckets = [furc_hash(f"session-{n}".encode(), 5) for n in range(2_000)]
    assert set(buckets) == set(range(5))  # every bucket used, none outside
    assert furc_hash(b"anything", 1) == 0
    # A bucket number, not the key, is what the ring position hashes: equal buckets, equal
    # positions.
    a, b = "header:x-session-id:chat:1", "header:x-session-id:chat:2"
    assert (fbi_hash(a) == fbi_hash(b)) == (
        furc_hash(a.encode(), 2**23 - 1) == furc_hash(b.encode(), 2**23 - 1)
    )


# Placements the real vllm-router 0.1.17 logged (``Consistent hash routing: key=... ->
# worker=...``) for workers http://127.0.0.1:27400 and :27410, in that --worker-urls order.
ROUTER_PLACED = {
    "chat:0": 1,
    "chat:100": 1,
    "chat:101": 0,
    "chat:102": 1,
    "chat:103": 0,
    "chat:104": 1,
    "chat:105": 1,
    "chat:106": 1,
    "chat:107": 0,
    "chat:108": 0,
    "chat:109": 1,
    "chat:11": 1,
}


def test_the_ring_places_sessions_where_the_real_router_did() -> None:
    ring = ConsistentHashRouter(2, worker_urls=["http://127.0.0.1:27400", "http://127.0.0.1:27410"])
    placed = {key: ring.worker_for_key(SESSION_HEADER_KEY + key) for key in ROUTER_PLACED}
    assert placed == ROUTER_PLACED


def test_consistent_hash_places_its_ring_by_the_worker_urls() -> None:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    one, same, other = (
        ConsistentHashRouter(2, worker_urls=urls),
        ConsistentHashRouter(2, worker_urls=list(urls)),
        ConsistentHashRouter(2, worker_urls=urls[::-1]),
    )
    keys = [f"{SESSION_HEADER_KEY}chat:{n}" for n in range(400)]
    placed = [one.worker_for_key(key) for key in keys]
    assert placed == [same.worker_for_key(key) for key in keys]
    # The same URLs in the other order swap the replicas' names, not the placement.
    assert [1 - other.worker_for_key(key) for key in keys] == placed
    assert 0.35 < placed.count(0) / len(keys) < 0.65
    with pytest.raises(RoutingError, match="3 worker URLs given for 2 replicas"):
        ConsistentHashRouter(2, worker_urls=[*urls, "http://10.0.0.3:8000"])


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"cache_threshold": 1.5}, "--cache-threshold"),
        ({"balance_abs_threshold": -1}, "--balance-abs-threshold"),
        ({"balance_rel_threshold": 0.9}, "--balance-rel-threshold"),
        ({"balance_rel_threshold": math.nan}, "--balance-rel-threshold"),
    ],
)
def test_bad_cache_aware_thresholds_are_refused_naming_the_flag(fields, flag) -> None:
    with pytest.raises(RoutingError, match=flag):
        CacheAwareConfig(**fields)


def test_cache_aware_thresholds_reach_the_router() -> None:
    config = CacheAwareConfig(balance_abs_threshold=0, balance_rel_threshold=1.0)
    router = make_router("cache_aware", 2, cache_aware=config)
    assert isinstance(router, CacheAwareRouter) and router.config is config
    view = NoCacheView([0, 0])
    assert router.route(_request([1, 2, 3, 4]), view) == 0
    view.loads = [1, 0]  # any difference is an imbalance now: least load wins over the tree
    assert router.route(_request([1, 2, 3, 4]), view) == 1
