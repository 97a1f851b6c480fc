"""The simulator's two modes, its bounds and its reports."""

from __future__ import annotations

import pytest

from arc_evictor.policies import PolicyError, make_policy, policy_names
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.generate import (
    ConversationParams,
    DocQAParams,
    conversation,
    docqa,
    write_generated,
)
from arc_simulator.pool import BlockPool
from arc_simulator.simulate import CostModel, simulate, simulate_sequential, sweep


def request(keys: list[int], *, index: int = 0, at: float = 0.0, output: int = 4) -> TraceRequest:
    """A request of full 16-token blocks plus one token, so every block can hit."""
    return TraceRequest(
        index=index,
        line=index + 1,
        timestamp_s=at,
        input_length=16 * len(keys) + 1,
        output_length=output,
        hash_ids=(*keys, -1),
        keys=tuple(keys),
        block_tokens=16,
    )


def trace(*key_lists: list[int], gap: float = 1.0) -> list[TraceRequest]:
    return [request(keys, index=i, at=i * gap) for i, keys in enumerate(key_lists)]


@pytest.fixture(scope="module")
def docqa_trace(tmp_path_factory) -> list[TraceRequest]:
    path = tmp_path_factory.mktemp("docqa") / "docqa.jsonl"
    params = DocQAParams(documents=60, document_tokens=800, questions_per_document=10, seed=3)
    write_generated(path, docqa(params), "bailian")
    return load_trace(path)


def test_hit_is_the_cached_prefix_and_the_first_miss_ends_it() -> None:
    result = simulate(trace([1, 2, 3], [1, 9, 3]), "lru", 10)
    # Block 3 is cached, but block 9 missed before it.
    assert (result.block_hits, result.block_queries) == (1, 6)


def test_lru_evicts_the_least_recently_released_block() -> None:
    # Capacity 3: [1, 2] released tail first leaves 2 older than 1, so [4] evicts 2
    # (1 hits later), and [2] then evicts 3.
    result = simulate(trace([1, 2], [3], [4], [1], [2]), "lru", 3)
    assert result.block_hits == 1
    assert result.evictions == 2


def test_a_request_never_evicts_its_own_cached_blocks() -> None:
    # Capacity 3, blocks 1 and 2 cached and least recent; request [1, 2, 5] must keep them.
    pool = BlockPool(make_policy("lru", 3))
    for keys in ([1, 2], [7]):
        pool.take(keys)
        pool.give_back(keys)
    assert pool.take([1, 2, 5]) == 2
    assert pool.is_cached(1) and pool.is_cached(2) and not pool.is_cached(7)


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_keeps_every_invariant_on_a_generated_trace(name, docqa_trace) -> None:
    capacity = 300
    sequential = simulate(docqa_trace, name, capacity, verify=True)
    overlapping = simulate(docqa_trace, name, capacity, sequential=False, verify=True)
    assert 0 < sequential.block_hits <= sequential.block_queries
    assert overlapping.requests == sequential.requests == len(docqa_trace)


def test_belady_bounds_every_policy(docqa_trace) -> None:
    results = sweep(docqa_trace, [*policy_names(), "belady"], [200, 800])
    for capacity in (200, 800):
        rows = {r.policy.split("-")[0]: r.block_hit_rate for r in results if r.capacity == capacity}
        assert rows["belady"] == max(rows.values())
        assert rows["belady"] > rows["lru"]


def test_arc_beats_lru_on_zipf_document_qa(docqa_trace) -> None:
    lru, arc = (simulate(docqa_trace, name, 400).block_hit_rate for name in ("lru", "arc"))
    assert arc > lru + 0.02


def test_rates_are_zero_not_one_for_an_empty_trace() -> None:
    for sequential in (True, False):
        result = simulate([], "arc", 10, sequential=sequential)
        assert result.block_hit_rate == 0.0 and result.token_hit_rate == 0.0
        assert result.requests == 0 and result.ttft_p50_s is None


def test_request_larger_than_the_pool_is_rejected_as_misses() -> None:
    result = simulate(trace([1, 2, 3, 4], [1]), "arc", 3)
    assert result.rejected_requests == 1
    assert (result.block_hits, result.block_queries) == (0, 5)


def test_final_p_is_reported_for_arc_only() -> None:
    requests = trace([1], [2], [1], [3], [4], [2])
    assert simulate(requests, "arc", 2).final_p is not None
    assert simulate(requests, "lru", 2).final_p is None


def test_overlapping_requests_pin_blocks_until_they_finish() -> None:
    # Two concurrent requests of 2 blocks on a 3-block pool: the second waits for the first.
    requests = [request([1, 2], index=0, at=0.0, output=100), request([3, 4], index=1, at=0.0)]
    cost = CostModel(prefill_seconds_per_token=0.0, decode_seconds_per_token=0.01, step_seconds=0.0)
    result = simulate(requests, "lru", 3, sequential=False, cost=cost)
    assert result.ttft_p99_s == pytest.approx(1.0)  # waited for 100 output tokens of 10 ms
    assert result.ttft_p50_s == pytest.approx(0.0)


def test_cached_tokens_shorten_modelled_ttft() -> None:
    cost = CostModel(
        prefill_seconds_per_token=0.001, decode_seconds_per_token=0.0, step_seconds=0.0
    )
    requests = [request([1, 2, 3], index=0, at=0.0), request([1, 2, 3], index=1, at=10.0)]
    result = simulate(requests, "lru", 10, sequential=False, cost=cost)
    assert result.ttft_p99_s == pytest.approx(0.049)  # nothing cached: 49 tokens computed
    assert result.ttft_p50_s == pytest.approx(0.001)  # 3 blocks cached: 1 token computed


def test_mean_in_flight_is_time_from_arrival_to_last_token_over_the_span() -> None:
    cost = CostModel(
        prefill_seconds_per_token=0.001, decode_seconds_per_token=0.01, step_seconds=0.0
    )
    # Each alone: 49 uncached tokens then 4 output tokens, 0.089 s; the second queues behind the
    # first's prefill (0.049 s) when both arrive at once.
    apart = [request([1, 2, 3], index=0, at=0.0), request([4, 5, 6], index=1, at=10.0)]
    result = simulate(apart, "lru", 10, sequential=False, cost=cost)
    assert result.mean_in_flight == pytest.approx(2 * 0.089 / 10.089)
    together = [request([1, 2, 3], index=0, at=0.0), request([4, 5, 6], index=1, at=0.0)]
    result = simulate(together, "lru", 10, sequential=False, cost=cost)
    assert result.mean_in_flight == pytest.approx((0.089 + 0.138) / 0.138)
    assert simulate(together, "lru", 10, cost=cost).mean_in_flight == pytest.approx(2.0)
    assert simulate([], "lru", 10).mean_in_flight is None


def test_batch_token_budget_makes_requests_wait() -> None:
    cost = CostModel(
        prefill_seconds_per_token=0.0,
        decode_seconds_per_token=0.01,
        step_seconds=0.0,
        max_batch_tokens=60,
    )
    requests = [request([1, 2], index=0, output=10), request([3, 4], index=1, output=10)]
    result = simulate(requests, "lru", 100, sequential=False, cost=cost)
    assert result.ttft_p99_s == pytest.approx(0.1)


def test_cost_model_rejects_negative_and_infinite_values() -> None:
    with pytest.raises(ValueError, match="prefill_seconds_per_token"):
        CostModel(prefill_seconds_per_token=-1.0)
    with pytest.raises(ValueError, match="decode_seconds_per_token"):
        CostModel(decode_seconds_per_token=float("inf"))
    with pytest.raises(ValueError, match="max_batch_tokens"):
        CostModel(max_batch_tokens=0)


def test_sweep_checks_names_and_capacities_before_running() -> None:
    with pytest.raises(PolicyError, match="valid policies: lru, dbl, arc"):
        sweep(trace([1]), ["lru", "mru"], [10])
    with pytest.raises(ValueError, match="at least 1 block"):
        sweep(trace([1]), ["lru"], [10, 0])


def test_sequential_mode_replays_the_same_counts_twice(docqa_trace) -> None:
    first = simulate_sequential(docqa_trace, make_policy("arc", 250))
    second = simulate_sequential(docqa_trace, make_policy("arc", 250))
    assert (first.block_hits, first.evictions, first.final_p) == (
        second.block_hits,
        second.evictions,
        second.final_p,
    )


def test_conversation_turns_hit_their_previous_context(tmp_path) -> None:
    path = tmp_path / "chat.jsonl"
    params = ConversationParams(sessions=20, mean_turns=3, think_time_s=1.0, seed=1)
    write_generated(path, conversation(params), "bailian")
    requests = load_trace(path)
    pool = BlockPool(make_policy("lru", 100_000))
    hits = {}
    for request in requests:
        hits[request.chat_id] = pool.take(request.keys)
        pool.give_back(request.keys)
    by_id = {request.chat_id: request for request in requests}
    later_turns = [r for r in requests if r.parent_id is not None]
    assert later_turns
    # With an unbounded cache a turn hits exactly its previous turn's full blocks: the block
    # after them held the previous turn's partial tail, which this turn extends.
    for request in later_turns:
        assert hits[request.chat_id] == by_id[request.parent_id].num_blocks
