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

Both modes report each replica's utilisation (``SimulationResult.utilisations``):
how much of the trace's span its two finite resources are busy, the serial
prefill lane (time) and, in overlapping mode, the block pool (pinned blocks);
and its peak utilisation (``peak_utilisations``), the prefill work arriving in the
busiest tenth of the span, which decides overload (``overloaded``).

A request with more blocks than the pool is rejected (vLLM refuses a prompt
longer than its KV cache): its blocks count as queries that miss.

Both modes run on ``Replica`` (one pool, queue and running batch) through
``replay_sequential`` and ``replay_overlapping``: one replica here is a fleet of
one, and ``arc_simulator.fleet`` runs the same code with several replicas behind
a router.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
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

    Two resources are finite: the serial prefill lane (time) and, in overlapping
    mode, the block pool a running request pins from admission to its last output
    token (memory). Decode has no shared throughput (every request decodes at its own
    rate whatever else runs): its seconds load a replica only through the blocks they
    keep pinned. ``SimulationResult.utilisations`` measures both.
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
    # Load (``record_load``): the trace's span and, per replica, the prefill lane's busy
    # time and the time integral of the pool's pinned blocks.
    span_s: float = 0.0
    prefill_busy_s: list[float] = field(default_factory=lambda: [0.0])
    pinned_block_s: list[float] = field(default_factory=lambda: [0.0])
    peak_prefill_s: list[float] = field(default_factory=lambda: [0.0])
    # Per replica, the summed time from each served request's arrival to its last output
    # token; and the time from the first arrival to the last request's end.
    in_flight_s: list[float] = field(default_factory=lambda: [0.0])
    service_span_s: float = 0.0

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

    @property
    def mean_in_flight(self) -> float | None:
        """Requests in flight per replica on average from the first arrival to the last
        request's end (Little's law: summed arrival-to-end times over that span, per
        replica); what the fleet demo measures on the real servers. None for an empty span."""
        if self.service_span_s <= 0:
            return None
        return sum(self.in_flight_s) / self.service_span_s / self.replicas

    @property
    def prefill_utilisations(self) -> list[float] | None:
        """Per replica, ``prefill_busy_s / span_s``: the busy time of the serial prefill
        lane (``step_seconds`` plus uncached prompt tokens times
        ``prefill_seconds_per_token`` for each request served; cached tokens and
        rejected requests cost nothing) over the trace's span (last arrival minus
        first). None when the span is 0."""
        if self.span_s <= 0:
            return None
        return [busy / self.span_s for busy in self.prefill_busy_s]

    @property
    def kv_utilisations(self) -> list[float] | None:
        """Per replica, ``pinned_block_s / (capacity x span_s)``: the time integral of
        the pool's pinned blocks (a request pins its blocks from admission to its last
        output token, so this is where decode time counts; blocks shared by running
        requests count once) over the pool's blocks times the span. 0 in sequential
        mode, where nothing stays pinned. None when the span is 0."""
        if self.span_s <= 0:
            return None
        return [pinned / (self.capacity * self.span_s) for pinned in self.pinned_block_s]

    @property
    def utilisations(self) -> list[float] | None:
        """Each replica's utilisation: the larger of its prefill and its KV utilisation
        (``prefill_utilisations``, ``kv_utilisations``), the resource that binds first.

        Both are work done over the span, and neither resource can do more than one
        span's worth within it, so at 1 or more the replica is busy until the last
        arrival or later: its queue does not drain while the trace runs. None when the
        span is 0 (one arrival time: no rate to serve).
        """
        prefill, kv = self.prefill_utilisations, self.kv_utilisations
        if prefill is None or kv is None:
            return None
        return [max(pair) for pair in zip(prefill, kv, strict=True)]

    @property
    def max_utilisation(self) -> float | None:
        """The busiest replica's utilisation; None when the span is 0."""
        utilisations = self.utilisations
        return None if utilisations is None else max(utilisations)

    @property
    def peak_utilisations(self) -> list[float] | None:
        """Per replica, the larger of its KV utilisation and its prefill utilisation in the
        busiest tenth of the span: ``peak_prefill_s``, the prefill time of the requests it
        served that arrived in that tenth (``LOAD_WINDOWS`` equal windows from the first
        arrival, the last arrival in the last), over the tenth's length.

        Never below ``utilisations`` (the span's prefill utilisation is the mean of the
        tenths'). At 1 or more the replica falls behind for a tenth of the run or longer:
        work arrives faster than the lane serves it, so its queue grows over that stretch,
        which a busy middle hides from the span's average. None when the span is 0.
        """
        kv = self.kv_utilisations
        if kv is None:
            return None
        window = self.span_s / LOAD_WINDOWS
        pairs = zip(self.peak_prefill_s, kv, strict=True)
        return [max(peak / window, pool) for peak, pool in pairs]

    @property
    def max_peak_utilisation(self) -> float | None:
        """The largest ``peak_utilisations``; None when the span is 0."""
        peaks = self.peak_utilisations
        return None if peaks is None else max(peaks)

    @property
    def offered_prefill(self) -> float | None:
        """Prefill seconds the run asked of the fleet per second of trace time, in replicas
        (the sum of ``prefill_utilisations``; a fleet of N serves at most N). It counts the
        prefill this run's hits left to compute, so routing and policy change it."""
        prefill = self.prefill_utilisations
        return None if prefill is None else sum(prefill)

    @property
    def offered_kv(self) -> float | None:
        """Pinned block-seconds per second of trace time, in replicas' pools (the sum of
        ``kv_utilisations``)."""
        kv = self.kv_utilisations
        return None if kv is None else sum(kv)

    @property
    def offered_load(self) -> float | None:
        """The fleet's offered load in replicas: the larger of ``offered_prefill`` and
        ``offered_kv``, against a capacity of ``replicas``. None when the span is 0."""
        prefill, kv = self.offered_prefill, self.offered_kv
        return None if prefill is None or kv is None else max(prefill, kv)

    @property
    def overloaded(self) -> bool:
        """True when a replica's peak utilisation is 1 or more (``peak_utilisations``): the
        prefill arriving in a tenth of the span needs the whole tenth or more, or the
        pool's pinned blocks fill it for the whole span or more."""
        peak = self.max_peak_utilisation
        return peak is not None and peak >= 1.0

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["block_hit_rate"] = self.block_hit_rate
        row["token_hit_rate"] = self.token_hit_rate
        row["request_imbalance"] = self.request_imbalance
        row["prefill_imbalance"] = self.prefill_imbalance
        row["prefill_utilisation"] = self.prefill_utilisations
        row["kv_utilisation"] = self.kv_utilisations
        row["utilisation"] = self.utilisations
        row["max_utilisation"] = self.max_utilisation
        row["peak_utilisation"] = self.peak_utilisations
        row["max_peak_utilisation"] = self.max_peak_utilisation
        row["overloaded"] = self.overloaded
        row["offered_prefill"] = self.offered_prefill
        row["offered_kv"] = self.offered_kv
        row["offered_load"] = self.offered_load
        row["mean_in_flight"] = self.mean_in_flight
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


# Overload is judged on the prefill arriving in each tenth of the span (``peak_utilisations``).
LOAD_WINDOWS = 10


def trace_span(requests: Sequence[TraceRequest]) -> float:
    """The trace's span: its last arrival minus its first (0 for fewer than two)."""
    if not requests:
        return 0.0
    times = [request.timestamp_s for request in requests]
    return max(times) - min(times)


def record_load(
    result: SimulationResult, replicas: Sequence[Replica], requests: Sequence[TraceRequest]
) -> None:
    """Set ``result``'s span and each replica's busy time and pinned block-seconds
    (``utilisations``)."""
    result.span_s = span = trace_span(requests)
    result.prefill_busy_s = [replica.prefill_busy_s for replica in replicas]
    result.in_flight_s = [replica.in_flight_s for replica in replicas]
    ends = [replica.last_end for replica in replicas if replica.in_flight_s > 0]
    first = min((request.timestamp_s for request in requests), default=0.0)
    result.service_span_s = max(ends) - first if ends else 0.0
    result.pinned_block_s = [replica.pinned_block_s for replica in replicas]
    start = min((request.timestamp_s for request in requests), default=0.0)
    peaks = []
    for replica in replicas:
        windows = [0.0] * LOAD_WINDOWS
        if span > 0:
            for arrival, work in replica.prefill_log:
                index = int((arrival - start) / span * LOAD_WINDOWS)
                windows[min(index, LOAD_WINDOWS - 1)] += work
        peaks.append(max(windows))
    result.peak_prefill_s = peaks


MAX_TIME_SCALE = 1000.0  # beyond it a trace's hours become years; a typo, not a study


def check_time_scale(factor: float) -> None:
    """Raise ValueError naming ``--time-scale`` unless 0 < ``factor`` <= ``MAX_TIME_SCALE``."""
    if not (math.isfinite(factor) and 0 < factor <= MAX_TIME_SCALE):
        raise ValueError(f"--time-scale must be a number in (0, {MAX_TIME_SCALE:g}], got {factor}")


def time_scaled(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """``requests`` with every inter-arrival time multiplied by ``factor`` (the request
    rate divided by it): arrival t becomes t0 + (t - t0) x factor, t0 the first arrival.
    Nothing else changes; factor 1 returns the requests themselves."""
    check_time_scale(factor)
    if factor == 1 or not requests:
        return list(requests)
    start = min(request.timestamp_s for request in requests)
    return [
        replace(request, timestamp_s=start + (request.timestamp_s - start) * factor)
        for request in requests
    ]


def record_ttfts(result: SimulationResult, ttfts: list[float]) -> None:
    """Set ``result``'s TTFT percentiles from every admitted request's TTFT (sorts them)."""
    ttfts.sort()
    result.ttft_p50_s = percentile(ttfts, 0.50)
    result.ttft_p90_s = percentile(ttfts, 0.90)
    result.ttft_p99_s = percentile(ttfts, 0.99)


@dataclass(slots=True)
class Replica:
    """One vLLM replica: its block pool, its first-come first-served queue and running batch.

    The only implementation of both modes' steps: one replica is a fleet of one
    (``simulate_sequential``, ``simulate_overlapping``), and ``arc_simulator.fleet`` runs
    several behind a router.

    Invariants (overlapping mode): ``queue`` holds (position in the trace, request) of the
    requests routed here and not yet admitted or rejected, in arrival order; ``running`` is a
    heap of (finish time, position, request) of the admitted requests whose blocks are still
    pinned, and ``running_tokens`` sums their prompt and output tokens; ``load`` counts the
    queued and running requests; ``now`` never exceeds the limit of the last ``advance``;
    ``blocked_until`` is, while the queue's head waits for room, the finish time of the first
    running request (only a completion can make room), and -inf otherwise. In sequential mode
    the queue and the batch stay empty and the caller keeps ``load``.

    What a router in front learns (both modes, kept only when ``routed``): ``published_at``
    maps each key this replica computed to when its ``BlockStored`` event reached the router,
    the end of the prefill that computed it (vLLM publishes a block after the engine step
    that computed it; the model's steps are whole prefills); ``prefill_ends`` maps the trace
    index of each request routed here to the end of its prefill, infinity while it is queued,
    until a router has seen it end.

    The load (both modes; ``record_load`` reads it): ``prefill_busy_s`` sums the prefill
    lane's time per request served, ``prefill_log`` holds (arrival, that time) for each, and
    ``pinned_block_s`` integrates the pool's pinned blocks over time up to ``pinned_since``
    (overlapping mode only; sequential mode pins nothing over time); ``in_flight_s`` sums
    each served request's time from arrival to its last output token, and ``last_end`` is
    the latest such end.
    """

    pool: BlockPool
    result: SimulationResult
    cost: CostModel
    verify: bool = False  # check every pool invariant after each admission
    queue: deque[tuple[int, TraceRequest]] = field(default_factory=deque)
    running: list[tuple[float, int, TraceRequest]] = field(default_factory=list)
    running_tokens: int = 0
    prefill_free_at: float = 0.0
    now: float = 0.0
    blocked_until: float = -math.inf
    load: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens served, the compute spent
    prefill_busy_s: float = 0.0  # the prefill lane's busy time: step + uncached prefill
    pinned_block_s: float = 0.0  # the time integral of the pool's pinned blocks
    prefill_log: list[tuple[float, float]] = field(default_factory=list)  # (arrival, prefill)
    pinned_since: float = 0.0  # when the pinned count last changed (overlapping mode)
    ttfts: list[float] = field(default_factory=list)
    in_flight_s: float = 0.0  # summed arrival-to-end time of the requests served
    last_end: float = 0.0  # when the last request served here ends
    routed: bool = False
    published_at: dict[int, float] = field(default_factory=dict)
    prefill_ends: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        policy: EvictionPolicy,
        mode: str,
        cost: CostModel,
        verify: bool = False,
        *,
        routed: bool = False,
    ) -> Replica:
        """An empty replica whose pool runs ``policy``; ``routed`` keeps what a router learns."""
        result = SimulationResult(policy.describe(), policy.capacity, mode)
        return cls(BlockPool(policy), result, cost, verify, routed=routed)

    def published_prefix(self, keys: Sequence[int], now: float) -> int:
        """Blocks of ``keys``' prefix cached here whose ``BlockStored`` reached the router
        by ``now`` (a ``BlockRemoved`` reaches it at once)."""
        cached, published_at = self.pool.is_cached, self.published_at
        for position, key in enumerate(keys):
            if not cached(key) or published_at[key] > now:
                return position
        return len(keys)

    def prefilling(self, now: float) -> set[int]:
        """Trace indexes of the requests routed here whose prefill has not ended by ``now``."""
        ends = self.prefill_ends
        for index in [index for index, end in ends.items() if end <= now]:
            del ends[index]
        return set(ends)

    def _computing(self, request: TraceRequest) -> list[int]:
        """The keys ``request`` will compute here: those not cached before it takes them."""
        cached = self.pool.is_cached
        return [key for key in request.keys if not cached(key)]

    def _publish(self, request: TraceRequest, computed: list[int], prefill_end: float) -> None:
        published_at = self.published_at
        for key in computed:
            published_at[key] = prefill_end
        self.prefill_ends[request.index] = prefill_end

    def serve_alone(self, request: TraceRequest) -> float:
        """Sequential mode: serve ``request`` now, alone; returns when it would finish
        unqueued (its arrival for a rejected request)."""
        pool, cost = self.pool, self.cost
        keys = request.keys
        if len(keys) > pool.capacity:
            count_rejected(self.result, request, pool.policy)
            return request.timestamp_s
        computed = self._computing(request) if self.routed else []
        hits = pool.serve_alone(keys, request.max_hit_blocks)
        count_served(self.result, request, hits)
        if self.verify:
            pool.verify()
        uncached = request.input_length - hits * request.block_tokens
        self.prefill_tokens += uncached
        prefill_time = cost.step_seconds + uncached * cost.prefill_seconds_per_token
        self.prefill_busy_s += prefill_time
        self.prefill_log.append((request.timestamp_s, prefill_time))
        prefill_end = request.timestamp_s + prefill_time
        if self.routed:
            self._publish(request, computed, prefill_end)
        finish = prefill_end + request.output_length * cost.decode_seconds_per_token
        self._served(request, finish)
        return finish

    def _served(self, request: TraceRequest, finish: float) -> None:
        self.in_flight_s += finish - request.timestamp_s
        self.last_end = max(self.last_end, finish)

    def enqueue(self, position: int, request: TraceRequest) -> None:
        """Overlapping mode: ``request`` (at ``position`` in the trace) joins the queue."""
        self.queue.append((position, request))
        if self.routed:
            self.prefill_ends[request.index] = math.inf
        self.load += 1

    def advance(self, limit: float) -> None:
        """Overlapping mode: every admission and completion up to ``limit``, in order.

        The queue's head is rejected when larger than the pool, else admitted at
        max(now, its arrival) once the pool can pin its blocks and the batch has room for
        its tokens, completions releasing their blocks first; later requests wait behind it.
        """
        if self.blocked_until > limit:
            return  # the head still waits, and nothing completes before ``limit``
        pool, queue, running = self.pool, self.queue, self.running
        while queue:
            position, request = queue[0]
            if len(request.keys) > pool.capacity:
                self._unqueue()
                count_rejected(self.result, request, pool.policy)
                self.prefill_ends.pop(request.index, None)  # refused: no prefill to wait for
                self.load -= 1
                continue
            now = max(self.now, request.timestamp_s)
            while running and (running[0][0] <= now or not self._admissible(request)):
                if running[0][0] > limit:
                    self.now, self.blocked_until = now, running[0][0]
                    return  # the head waits for a completion after ``limit``
                finish, _position, done = heapq.heappop(running)
                now = max(now, finish)
                self._release(done, finish)
            self.now = now
            self._unqueue()
            self._admit(position, request)
        while running and running[0][0] <= limit:
            finish, _position, done = heapq.heappop(running)
            self._release(done, finish)

    def _unqueue(self) -> None:
        self.queue.popleft()
        self.blocked_until = -math.inf

    def _admissible(self, request: TraceRequest) -> bool:
        pool = self.pool
        if pool.num_pinned + pool.blocks_to_pin(request.keys) > pool.capacity:
            return False
        tokens = request.input_length + request.output_length
        return not self.running or self.running_tokens + tokens <= self.cost.max_batch_tokens

    def _pinned_until(self, moment: float) -> None:
        """Add the pinned blocks' block-seconds from the last change up to ``moment``."""
        if moment > self.pinned_since:
            self.pinned_block_s += self.pool.num_pinned * (moment - self.pinned_since)
            self.pinned_since = moment

    def _release(self, done: TraceRequest, finish: float) -> None:
        self._pinned_until(finish)
        self.pool.give_back(done.keys)
        self.running_tokens -= done.input_length + done.output_length
        self.load -= 1

    def _admit(self, position: int, request: TraceRequest) -> None:
        cost = self.cost
        computed = self._computing(request) if self.routed else []
        self._pinned_until(self.now)
        hits = self.pool.take(request.keys, request.max_hit_blocks)
        count_served(self.result, request, hits)
        uncached = request.input_length - hits * request.block_tokens
        self.prefill_tokens += uncached
        prefill_start = max(self.now, self.prefill_free_at)
        prefill_time = cost.step_seconds + uncached * cost.prefill_seconds_per_token
        self.prefill_busy_s += prefill_time
        self.prefill_log.append((request.timestamp_s, prefill_time))
        prefill_end = prefill_start + prefill_time
        self.prefill_free_at = prefill_end
        if self.routed:
            self._publish(request, computed, prefill_end)
        self.ttfts.append(prefill_end - request.timestamp_s)
        finish = prefill_end + request.output_length * cost.decode_seconds_per_token
        self._served(request, finish)
        heapq.heappush(self.running, (finish, position, request))
        self.running_tokens += request.input_length + request.output_length
        if self.verify:
            self.pool.verify()


# Places a request on one of the replicas; called once per request, at its arrival, in order.
Route = Callable[[TraceRequest], int]


def replay_sequential(
    requests: Sequence[TraceRequest], replicas: Sequence[Replica], route: Route
) -> None:
    """Sequential mode: each request, in file order, served alone on the replica ``route``
    picks. A replica's ``load`` counts the requests routed to it that have not finished
    their unqueued service time by the next arrival."""
    in_flight: list[tuple[float, int]] = []  # (finish time, replica)
    for request in requests:
        while in_flight and in_flight[0][0] <= request.timestamp_s:
            replicas[heapq.heappop(in_flight)[1]].load -= 1
        chosen = route(request)
        replica = replicas[chosen]
        finish = replica.serve_alone(request)
        replica.load += 1
        heapq.heappush(in_flight, (finish, chosen))


def replay_overlapping(
    requests: Sequence[TraceRequest], replicas: Sequence[Replica], route: Route
) -> None:
    """Overlapping mode: at each arrival every replica is advanced to it (admissions and
    completions up to then have happened, later ones have not), then the request joins the
    queue of the replica ``route`` picks; at the end every replica runs dry."""
    for position, request in enumerate(requests):
        now = request.timestamp_s
        for replica in replicas:
            replica.advance(now)
        chosen = replicas[route(request)]
        chosen.enqueue(position, request)
        chosen.advance(now)
    for replica in replicas:
        replica.advance(math.inf)


def _only_replica(request: TraceRequest) -> int:
    del request  # one replica takes every request
    return 0


def simulate_sequential(
    requests: Sequence[TraceRequest],
    policy: EvictionPolicy,
    *,
    verify: bool = False,
    cost: CostModel | None = None,
) -> SimulationResult:
    """The sequential mode; ``verify`` checks every invariant after each request. ``cost``
    only sets the prefill busy time (``utilisations``): hits do not depend on it."""
    replica = Replica.of(policy, "sequential", cost or CostModel(), verify)
    started = time.perf_counter()
    replay_sequential(requests, [replica], _only_replica)
    record_load(replica.result, [replica], requests)
    return _finish(replica.result, replica.pool, started)


def simulate_overlapping(
    requests: Sequence[TraceRequest],
    policy: EvictionPolicy,
    cost: CostModel | None = None,
    *,
    verify: bool = False,
) -> SimulationResult:
    """Requests overlap in time; see the module docstring and ``CostModel``."""
    replica = Replica.of(policy, "overlapping", cost or CostModel(), verify)
    started = time.perf_counter()
    replay_overlapping(requests, [replica], _only_replica)
    record_ttfts(replica.result, replica.ttfts)
    record_load(replica.result, [replica], requests)
    return _finish(replica.result, replica.pool, started)


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
        return simulate_sequential(requests, policy, verify=verify, cost=cost)
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
