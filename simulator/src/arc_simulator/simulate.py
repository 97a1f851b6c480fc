"""Replay traces through the block-pool model with any policy.

Two modes, both first-come first-served, so every policy (Belady included) sees
the requests' blocks in file order:

- Sequential (the reference for cross-checks): one request at a time.
  Count its hits (the resident prefix), take its blocks (``BlockPool.take``:
  cached blocks first, then the misses, each pass tail first), release them
  tail first.
- Overlapping: requests arrive at their timestamps and hold (pin) their blocks
  from admission until they finish. A request is admitted when the pool can pin
  all its blocks and the running batch has room for its tokens; otherwise it
  waits, and so does everything behind it. Service time follows ``CostModel``;
  the result adds modelled time-to-first-token percentiles.

A request with more blocks than the pool is rejected (vLLM refuses a prompt
longer than its KV cache): its blocks count as queries that miss.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from arc_evictor.policies import EvictionPolicy, make_policy, policy_names
from arc_evictor.policies.base import PolicyError
from arc_serving_common.traces import TraceRequest
from arc_simulator.belady import Belady
from arc_simulator.pool import BlockPool


@dataclass(frozen=True, slots=True)
class CostModel:
    """A deliberately simple model of one vLLM replica's service time.

    - Prefill is compute-bound and serial: a request's uncached prompt tokens take
      ``prefill_seconds_per_token`` each, one prefill after another, plus
      ``step_seconds`` of fixed overhead. Cached tokens cost nothing.
    - Decode runs alongside everything else: ``decode_seconds_per_token`` per
      output token, per request.
    - The running batch holds at most ``max_batch_tokens`` tokens (prompt plus
      output, summed over running requests); a request that would exceed it waits.
      One request alone is always admitted.

    Defaults are of the order of an 8B model on one modern GPU.
    """

    prefill_seconds_per_token: float = 1.0 / 20_000
    decode_seconds_per_token: float = 0.02
    step_seconds: float = 0.005
    max_batch_tokens: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("prefill_seconds_per_token", "decode_seconds_per_token", "step_seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model {name} must be a finite number >= 0, got {value}")
        if self.max_batch_tokens < 1:
            raise ValueError(
                f"cost model max_batch_tokens must be >= 1, got {self.max_batch_tokens}"
            )


@dataclass(slots=True)
class SimulationResult:
    """What one policy at one capacity did on one trace."""

    policy: str
    capacity: int
    mode: str
    requests: int = 0
    rejected_requests: int = 0
    block_queries: int = 0
    block_hits: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    ghost_hits: dict[str, int] = field(default_factory=dict)
    final_p: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    seconds: float = 0.0
    # A fleet of replicas behind a router (``arc_simulator.fleet``); one replica otherwise.
    replicas: int = 1
    router: str | None = None
    request_shares: list[float] = field(default_factory=lambda: [1.0])
    prefill_token_shares: list[float] = field(default_factory=lambda: [1.0])

    @property
    def block_hit_rate(self) -> float:
        """Hit blocks over queried blocks; 0.0 (not 1.0) for an empty trace."""
        return self.block_hits / self.block_queries if self.block_queries else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Prompt tokens served from cache over prompt tokens; 0.0 for an empty trace."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def request_imbalance(self) -> float:
        """The busiest replica's share of requests times the replica count; 1.0 is even."""
        return max(self.request_shares) * self.replicas

    @property
    def prefill_imbalance(self) -> float:
        """The same for prefill (uncached prompt) tokens, the compute a replica spends."""
        return max(self.prefill_token_shares) * self.replicas

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["block_hit_rate"] = self.block_hit_rate
        row["token_hit_rate"] = self.token_hit_rate
        row["request_imbalance"] = self.request_imbalance
        row["prefill_imbalance"] = self.prefill_imbalance
        return row


def simulator_policy_names() -> list[str]:
    """Policies the simulator accepts: every registered policy plus Belady's bound."""
    return [*policy_names(), Belady.name]


def build_policy(name: str, capacity: int, requests: Sequence[TraceRequest]) -> EvictionPolicy:
    """A registered policy by name, or the Belady oracle built from ``requests``."""
    if name.strip().lower() == Belady.name:
        return Belady.for_requests(capacity, (r.keys for r in requests))
    try:
        return make_policy(name, capacity)
    except PolicyError:
        raise PolicyError(
            f"unknown eviction policy {name!r}; valid policies: "
            f"{', '.join(simulator_policy_names())}"
        ) from None


def count_served(result: SimulationResult, request: TraceRequest, hits: int) -> None:
    """Add a served request and its prefix hits to ``result``."""
    result.requests += 1
    result.block_queries += request.num_blocks
    result.block_hits += hits
    result.input_tokens += request.input_length
    result.hit_tokens += hits * request.block_tokens


def policy_statistics(policy: EvictionPolicy) -> tuple[dict[str, int], float | None]:
    """The policy's ghost hits per list and its adaptive target, for a result."""
    return dict(policy.counters.ghost_hits), policy.target


def _finish(result: SimulationResult, pool: BlockPool, started: float) -> SimulationResult:
    result.evictions = pool.evictions
    result.ghost_hits, result.final_p = policy_statistics(pool.policy)
    result.seconds = time.perf_counter() - started
    return result


def simulate_sequential(
    requests: Sequence[TraceRequest], policy: EvictionPolicy, *, verify: bool = False
) -> SimulationResult:
    """The sequential mode; ``verify`` checks every invariant after each request."""
    pool = BlockPool(policy)
    result = SimulationResult(policy.describe(), policy.capacity, "sequential")
    started = time.perf_counter()
    for request in requests:
        keys = request.keys
        if len(keys) > pool.capacity:
            count_rejected(result, request, policy)
            continue
        hits = pool.take(keys, request.max_hit_blocks)
        pool.give_back(keys)
        count_served(result, request, hits)
        if verify:
            pool.verify()
    return _finish(result, pool, started)


def count_rejected(result: SimulationResult, request: TraceRequest, policy: EvictionPolicy) -> None:
    """Add a request too large for the pool: its blocks are queries that miss."""
    result.rejected_requests += 1
    result.requests += 1
    result.block_queries += request.num_blocks
    result.input_tokens += request.input_length
    if isinstance(policy, Belady):
        policy.skip(request.keys)  # the oracle counts uses per find; this request uses none


def percentile(sorted_values: Sequence[float], fraction: float) -> float | None:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def simulate_overlapping(
    requests: Sequence[TraceRequest],
    policy: EvictionPolicy,
    cost: CostModel | None = None,
    *,
    verify: bool = False,
) -> SimulationResult:
    """Requests overlap in time; see the module docstring and ``CostModel``."""
    cost = cost or CostModel()
    pool = BlockPool(policy)
    result = SimulationResult(policy.describe(), policy.capacity, "overlapping")
    started = time.perf_counter()
    ttfts: list[float] = []
    running: list[tuple[float, int]] = []  # (finish time, request index)
    running_tokens = 0
    prefill_free_at = 0.0
    now = 0.0
    next_admit = 0  # first-come first-served: requests[next_admit] waits for everything

    def admissible(request: TraceRequest) -> bool:
        if pool.num_pinned + pool.blocks_to_pin(request.keys) > pool.capacity:
            return False
        tokens = request.input_length + request.output_length
        return not running or running_tokens + tokens <= cost.max_batch_tokens

    while next_admit < len(requests):
        request = requests[next_admit]
        if len(request.keys) > pool.capacity:
            count_rejected(result, request, policy)
            next_admit += 1
            continue
        now = max(now, request.timestamp_s)
        # Release everything that finished by now, then admit in order while possible.
        while running and (running[0][0] <= now or not admissible(request)):
            finish, index = heapq.heappop(running)
            now = max(now, finish)
            done = requests[index]
            pool.give_back(done.keys)
            running_tokens -= done.input_length + done.output_length
        hits = pool.take(request.keys, request.max_hit_blocks)
        count_served(result, request, hits)
        cached = hits * request.block_tokens
        prefill_start = max(now, prefill_free_at)
        prefill_end = (
            prefill_start
            + cost.step_seconds
            + (request.input_length - cached) * cost.prefill_seconds_per_token
        )
        prefill_free_at = prefill_end
        ttfts.append(prefill_end - request.timestamp_s)
        finish = prefill_end + request.output_length * cost.decode_seconds_per_token
        heapq.heappush(running, (finish, next_admit))
        running_tokens += request.input_length + request.output_length
        next_admit += 1
        if verify:
            pool.verify()
    while running:
        _finish_time, index = heapq.heappop(running)
        pool.give_back(requests[index].keys)
    ttfts.sort()
    result.ttft_p50_s = percentile(ttfts, 0.50)
    result.ttft_p90_s = percentile(ttfts, 0.90)
    result.ttft_p99_s = percentile(ttfts, 0.99)
    return _finish(result, pool, started)


def simulate(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity: int,
    *,
    sequential: bool = True,
    cost: CostModel | None = None,
    verify: bool = False,
) -> SimulationResult:
    """Replay ``requests`` with policy ``policy_name`` on a pool of ``capacity`` blocks."""
    policy = build_policy(policy_name, capacity, requests)
    if sequential:
        return simulate_sequential(requests, policy, verify=verify)
    return simulate_overlapping(requests, policy, cost, verify=verify)


def sweep(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    sequential: bool = True,
    cost: CostModel | None = None,
) -> list[SimulationResult]:
    """Every policy at every capacity; names and capacities are checked up front."""
    for name in policies:
        build_policy(name, 1, [])
    for capacity in capacities:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 block, got {capacity}")
    return [
        simulate(requests, name, capacity, sequential=sequential, cost=cost)
        for capacity in capacities
        for name in policies
    ]
