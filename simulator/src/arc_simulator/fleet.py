"""A fleet of vLLM replicas behind a router, each with its own block pool.

Every replica is the single-replica model of ``arc_simulator.simulate`` with a
pool of ``capacity`` blocks (the capacity is per replica, what one pod's KV
cache holds) and its own eviction policy. A router (``arc_simulator.routing``)
places each request at its arrival from what it may know then (``FleetView``).

- Sequential: each request is served alone on its replica (take its blocks,
  release them), in file order. There is no queue, but requests still take time:
  a request is in flight on its replica from its arrival for the unqueued service
  time of ``CostModel`` (fixed step, uncached prefill, decode), and the loads a
  router sees count requests in flight.
- Overlapping: each replica runs the overlapping model of ``simulate`` on the
  requests routed to it: its own first-come first-served queue, prefill that is
  serial per replica and a running batch, so a replica sent more than its share
  queues and its requests' time to first token grows. A router at time t sees
  each replica after every admission and completion up to t.

With one replica both modes give exactly the single-replica results. Belady's
bound needs each replica's future request stream, which depends on routing
decisions not yet made, so a fleet of more than one replica does not take it.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from arc_serving_common.traces import TraceRequest
from arc_simulator.belady import Belady
from arc_simulator.pool import BlockPool
from arc_simulator.routing import RoutingError, check_replicas, make_router
from arc_simulator.simulate import (
    CostModel,
    SimulationResult,
    build_policy,
    count_rejected,
    count_served,
    percentile,
    policy_statistics,
)


@dataclass(slots=True)
class _Replica:
    """One replica's pool, queue and running batch (overlapping mode).

    Invariants: ``queue`` holds (position in the trace, request) of the requests
    routed here and not yet admitted or rejected, in arrival order; ``running``
    is a heap of (finish time, position) of admitted requests whose blocks are
    still pinned; ``now`` never exceeds the limit of the last ``advance``;
    ``pending`` maps each key of the queued requests to how many hold it.
    """

    pool: BlockPool
    result: SimulationResult
    queue: deque[tuple[int, TraceRequest]] = field(default_factory=deque)
    running: list[tuple[float, int]] = field(default_factory=list)
    pending: dict[int, int] = field(default_factory=dict)
    running_tokens: int = 0
    prefill_free_at: float = 0.0
    now: float = 0.0
    load: int = 0
    prefill_tokens: int = 0


class _View:
    """The fleet as a router sees it; see ``routing.FleetView``."""

    def __init__(self, replicas: Sequence[_Replica], loads: list[int]) -> None:
        self._replicas = replicas
        self.loads = loads
        self.now = 0.0

    def cached_prefix(self, replica: int, keys: Sequence[int]) -> int:
        state = self._replicas[replica]
        pool, pending = state.pool, state.pending
        for position, key in enumerate(keys):
            if not (pool.is_cached(key) or key in pending):
                return position
        return len(keys)


class _Fleet:
    """Replicas, the router's view of them, and the overlapping-mode event loop."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        policy_name: str,
        capacity: int,
        replicas: int,
        mode: str,
    ) -> None:
        self.requests = requests
        self.replicas: list[_Replica] = []
        for _ in range(replicas):
            policy = build_policy(policy_name, capacity, requests)
            result = SimulationResult(policy.describe(), capacity, mode)
            self.replicas.append(_Replica(BlockPool(policy), result))
        self.loads = [0] * replicas
        self.view = _View(self.replicas, self.loads)
        self.ttfts: list[float] = []

    def serve_alone(self, replica: int, request: TraceRequest, cost: CostModel) -> float:
        """Sequential mode: serve ``request`` on ``replica``; returns its finish time."""
        state = self.replicas[replica]
        pool = state.pool
        keys = request.keys
        if len(keys) > pool.capacity:
            count_rejected(state.result, request, pool.policy)
            return request.timestamp_s
        hits = pool.take(keys, request.max_hit_blocks)
        pool.give_back(keys)
        count_served(state.result, request, hits)
        uncached = request.input_length - hits * request.block_tokens
        state.prefill_tokens += uncached
        return (
            request.timestamp_s
            + cost.step_seconds
            + uncached * cost.prefill_seconds_per_token
            + request.output_length * cost.decode_seconds_per_token
        )

    def enqueue(self, replica: int, position: int, request: TraceRequest) -> None:
        state = self.replicas[replica]
        state.queue.append((position, request))
        pending = state.pending
        for key in request.keys:
            pending[key] = pending.get(key, 0) + 1
        self.loads[replica] += 1

    @staticmethod
    def _unqueue(state: _Replica) -> None:
        _position, request = state.queue.popleft()
        pending = state.pending
        for key in request.keys:
            count = pending[key] - 1
            if count:
                pending[key] = count
            else:
                del pending[key]

    def advance(self, replica: int, limit: float, cost: CostModel) -> None:
        """Overlapping mode: every admission and completion on ``replica`` up to ``limit``.

        The steps and their order are ``simulate_overlapping``'s for the requests
        routed here, cut at ``limit``.
        """
        state = self.replicas[replica]
        pool, queue, running = state.pool, state.queue, state.running
        while queue:
            position, request = queue[0]
            if len(request.keys) > pool.capacity:
                self._unqueue(state)
                count_rejected(state.result, request, pool.policy)
                self.loads[replica] -= 1
                continue
            now = max(state.now, request.timestamp_s)
            while running and (running[0][0] <= now or not self._admissible(state, request, cost)):
                if running[0][0] > limit:
                    state.now = now
                    return  # the head waits for a completion after ``limit``
                finish, index = heapq.heappop(running)
                now = max(now, finish)
                self._release(replica, self.requests[index])
            state.now = now
            self._unqueue(state)
            self._admit(state, position, request, cost)
        while running and running[0][0] <= limit:
            _finish, index = heapq.heappop(running)
            self._release(replica, self.requests[index])

    def _admissible(self, state: _Replica, request: TraceRequest, cost: CostModel) -> bool:
        pool = state.pool
        if pool.num_pinned + pool.blocks_to_pin(request.keys) > pool.capacity:
            return False
        tokens = request.input_length + request.output_length
        return not state.running or state.running_tokens + tokens <= cost.max_batch_tokens

    def _release(self, replica: int, done: TraceRequest) -> None:
        state = self.replicas[replica]
        state.pool.give_back(done.keys)
        state.running_tokens -= done.input_length + done.output_length
        self.loads[replica] -= 1

    def _admit(
        self, state: _Replica, position: int, request: TraceRequest, cost: CostModel
    ) -> None:
        hits = state.pool.take(request.keys, request.max_hit_blocks)
        count_served(state.result, request, hits)
        uncached = request.input_length - hits * request.block_tokens
        state.prefill_tokens += uncached
        prefill_start = max(state.now, state.prefill_free_at)
        prefill_end = prefill_start + cost.step_seconds + uncached * cost.prefill_seconds_per_token
        state.prefill_free_at = prefill_end
        self.ttfts.append(prefill_end - request.timestamp_s)
        finish = prefill_end + request.output_length * cost.decode_seconds_per_token
        heapq.heappush(state.running, (finish, position))
        state.running_tokens += request.input_length + request.output_length


def _merge(fleet: _Fleet, router_name: str, mode: str, started: float) -> SimulationResult:
    """The fleet's result: counts summed over replicas, ARC's target averaged."""
    states = fleet.replicas
    first = states[0].result
    merged = SimulationResult(first.policy, first.capacity, mode)
    merged.replicas = len(states)
    merged.router = router_name
    targets: list[float | None] = []
    for state in states:
        part = state.result
        merged.requests += part.requests
        merged.rejected_requests += part.rejected_requests
        merged.block_queries += part.block_queries
        merged.block_hits += part.block_hits
        merged.input_tokens += part.input_tokens
        merged.hit_tokens += part.hit_tokens
        merged.evictions += state.pool.evictions
        ghost_hits, target = policy_statistics(state.pool.policy)
        for name, count in ghost_hits.items():
            merged.ghost_hits[name] = merged.ghost_hits.get(name, 0) + count
        targets.append(target)
    if all(target is not None for target in targets):
        merged.final_p = sum(targets) / len(targets)  # type: ignore[arg-type]
    total_requests = merged.requests or 1
    total_prefill = sum(state.prefill_tokens for state in states) or 1
    merged.request_shares = [state.result.requests / total_requests for state in states]
    merged.prefill_token_shares = [state.prefill_tokens / total_prefill for state in states]
    if mode == "overlapping":
        fleet.ttfts.sort()
        merged.ttft_p50_s = percentile(fleet.ttfts, 0.50)
        merged.ttft_p90_s = percentile(fleet.ttfts, 0.90)
        merged.ttft_p99_s = percentile(fleet.ttfts, 0.99)
    merged.seconds = time.perf_counter() - started
    return merged


def check_fleet(policy_name: str, replicas: int) -> None:
    """Raise RoutingError for a fleet this model cannot simulate."""
    check_replicas(replicas)
    if replicas > 1 and policy_name.strip().lower() == Belady.name:
        raise RoutingError(
            "policy belady needs each replica's future requests, which routing decides "
            "as it goes; use it with --replicas 1 only"
        )


def simulate_fleet(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity: int,
    replicas: int,
    router_name: str,
    *,
    sequential: bool = True,
    cost: CostModel | None = None,
    seed: int = 0,
) -> tuple[SimulationResult, list[int]]:
    """Route ``requests`` over ``replicas`` replicas of ``capacity`` blocks each.

    Returns the fleet's result (counts summed over replicas, load shares per
    replica) and the replica each request was sent to, in request order.
    """
    check_fleet(policy_name, replicas)
    router = make_router(router_name, replicas, seed)
    cost = cost or CostModel()
    mode = "sequential" if sequential else "overlapping"
    fleet = _Fleet(requests, policy_name, capacity, replicas, mode)
    view, loads = fleet.view, fleet.loads
    decisions: list[int] = []
    started = time.perf_counter()
    if sequential:
        in_flight: list[tuple[float, int]] = []  # (finish time, replica)
        for request in requests:
            now = request.timestamp_s
            while in_flight and in_flight[0][0] <= now:
                loads[heapq.heappop(in_flight)[1]] -= 1
            view.now = now
            chosen = router.route(request, view)
            decisions.append(chosen)
            finish = fleet.serve_alone(chosen, request, cost)
            loads[chosen] += 1
            heapq.heappush(in_flight, (finish, chosen))
    else:
        for position, request in enumerate(requests):
            now = request.timestamp_s
            for replica in range(replicas):
                fleet.advance(replica, now, cost)
            view.now = now
            chosen = router.route(request, view)
            decisions.append(chosen)
            fleet.enqueue(chosen, position, request)
            fleet.advance(chosen, now, cost)
        for replica in range(replicas):
            fleet.advance(replica, float("inf"), cost)
    return _merge(fleet, router.name, mode, started), decisions


def fleet_sweep(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    capacities: Sequence[int],
    replicas: int,
    routers: Sequence[str],
    *,
    sequential: bool = True,
    cost: CostModel | None = None,
    seed: int = 0,
) -> list[SimulationResult]:
    """Every router, policy and per-replica capacity; inputs are checked up front."""
    for name in policies:
        build_policy(name, 1, [])
        check_fleet(name, replicas)
    for name in routers:
        make_router(name, replicas, seed)
    for capacity in capacities:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 block, got {capacity}")
    return [
        simulate_fleet(
            requests,
            policy,
            capacity,
            replicas,
            router,
            sequential=sequential,
            cost=cost,
            seed=seed,
        )[0]
        for capacity in capacities
        for router in routers
        for policy in policies
    ]
