"""A fleet of vLLM replicas behind a router, each with its own block pool.

Every replica is a ``simulate.Replica``, the model ``arc_simulator.simulate``
runs as a fleet of one, with a pool of ``capacity`` blocks (the capacity is per
replica, what one pod's KV cache holds) and its own eviction policy. A router
(``arc_simulator.routing``) places each request at its arrival from what it may
know then (``FleetView``); ``simulate.replay_sequential`` and
``replay_overlapping`` drive the replicas in either mode.

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

Each replica's utilisation is the larger of its prefill lane's busy time and its
pool's pinned block-seconds, each over what the trace's span allows
(``SimulationResult.utilisations``); their sums are the fleet's offered load, in
replicas, against a capacity of ``replicas``.

With one replica both modes give exactly the single-replica results. Belady's
bound needs each replica's future request stream, which depends on routing
decisions not yet made, so a fleet of more than one replica does not take it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from arc_serving_common.sessions import session_keys
from arc_serving_common.traces import TraceRequest
from arc_simulator.belady import Belady
from arc_simulator.routing import (
    DEFAULT_LOAD_BOUND,
    CacheAwareConfig,
    Router,
    RoutingError,
    check_replicas,
    check_router,
    make_router,
)
from arc_simulator.simulate import (
    CostModel,
    Replica,
    SimulationResult,
    build_policy,
    policy_statistics,
    record_load,
    record_ttfts,
    replay_overlapping,
    replay_sequential,
)


class _View:
    """The fleet as a router sees it; see ``routing.FleetView``.

    Invariant: ``_sessions`` is empty or maps the trace index of every request of the run to
    its session key; it is filled at the first ``session_id``, since most routers ask none.
    """

    def __init__(self, replicas: Sequence[Replica], requests: Sequence[TraceRequest]) -> None:
        self._replicas = replicas
        self._requests = requests
        self._sessions: dict[int, str] = {}
        self.now = 0.0

    def session_id(self, request: TraceRequest) -> str:
        if not self._sessions:
            keys = session_keys(self._requests)
            self._sessions = {
                each.index: key for each, key in zip(self._requests, keys, strict=True)
            }
        return self._sessions[request.index]

    @property
    def loads(self) -> list[int]:
        return [replica.load for replica in self._replicas]

    def cached_prefix(self, replica: int, keys: Sequence[int]) -> int:
        return self._replicas[replica].published_prefix(keys, self.now)

    def prefilling(self, replica: int) -> set[int]:
        return self._replicas[replica].prefilling(self.now)


def _merge(
    replicas: Sequence[Replica],
    router_name: str,
    started: float,
    requests: Sequence[TraceRequest],
) -> SimulationResult:
    """The fleet's result: counts summed over replicas, ARC's target averaged."""
    first = replicas[0].result
    merged = SimulationResult(first.policy, first.capacity, first.mode)
    merged.replicas = len(replicas)
    merged.router = router_name
    targets: list[float | None] = []
    for replica in replicas:
        part = replica.result
        merged.requests += part.requests
        merged.rejected_requests += part.rejected_requests
        merged.block_queries += part.block_queries
        merged.block_hits += part.block_hits
        merged.input_tokens += part.input_tokens
        merged.hit_tokens += part.hit_tokens
        merged.evictions += replica.pool.evictions
        ghost_hits, target = policy_statistics(replica.pool.policy)
        for name, count in ghost_hits.items():
            merged.ghost_hits[name] = merged.ghost_hits.get(name, 0) + count
        targets.append(target)
    if all(target is not None for target in targets):
        merged.final_p = sum(targets) / len(targets)  # type: ignore[arg-type]
    total_requests = merged.requests or 1
    total_prefill = sum(replica.prefill_tokens for replica in replicas) or 1
    merged.request_shares = [replica.result.requests / total_requests for replica in replicas]
    merged.prefill_token_shares = [replica.prefill_tokens / total_prefill for replica in replicas]
    if merged.mode == "overlapping":
        record_ttfts(merged, [ttft for replica in replicas for ttft in replica.ttfts])
    record_load(merged, replicas, requests)
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
    temperature: float = 0.0,
    cache_aware: CacheAwareConfig | None = None,
    worker_urls: Sequence[str] | None = None,
    affinity_ttl_s: int | None = None,
    load_bound: float = DEFAULT_LOAD_BOUND,
) -> tuple[SimulationResult, list[int]]:
    """Route ``requests`` over ``replicas`` replicas of ``capacity`` blocks each.

    Returns the fleet's result (counts summed over replicas, load shares per
    replica) and the replica each request was sent to, in request order.
    ``temperature`` is the router's ``--router-temperature`` (``kv_aware`` only),
    ``cache_aware`` its ``cache_aware`` thresholds (the router's defaults if None),
    ``worker_urls`` its ``--worker-urls`` (``consistent_hash``'s ring), ``affinity_ttl_s``
    its ``--kv-aware-session-affinity-ttl-secs`` (``kv_aware`` only; None: off);
    ``load_bound`` is ``bounded_prefix``'s epsilon.
    """
    check_fleet(policy_name, replicas)
    router = make_router(
        router_name, replicas, seed, temperature, cache_aware, worker_urls, affinity_ttl_s,
        load_bound,
    )  # fmt: skip
    return simulate_routed(
        requests, policy_name, capacity, replicas, router, sequential=sequential, cost=cost
    )


def simulate_routed(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity: int,
    replicas: int,
    router: Router,
    *,
    sequential: bool = True,
    cost: CostModel | None = None,
) -> tuple[SimulationResult, list[int]]:
    """``simulate_fleet`` with a router of the caller's own, for example one that replays
    the placement a real router recorded."""
    check_fleet(policy_name, replicas)
    cost = cost or CostModel()
    mode = "sequential" if sequential else "overlapping"
    # One replica is never scored, so it keeps nothing for a router.
    fleet = [
        Replica.of(build_policy(policy_name, capacity, requests), mode, cost, routed=replicas > 1)
        for _ in range(replicas)
    ]
    view = _View(fleet, requests)
    decisions: list[int] = []

    def route(request: TraceRequest) -> int:
        view.now = request.timestamp_s
        chosen = router.route(request, view)
        decisions.append(chosen)
        return chosen

    started = time.perf_counter()
    replay = replay_sequential if sequential else replay_overlapping
    replay(requests, fleet, route)
    return _merge(fleet, router.name, started, requests), decisions


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
    temperature: float = 0.0,
    affinity_ttl_s: int | None = None,
) -> list[SimulationResult]:
    """Every router, policy and per-replica capacity; inputs are checked up front."""
    for name in policies:
        build_policy(name, 1, [])
        check_fleet(name, replicas)
    for name in routers:
        check_router(name, replicas, temperature, affinity_ttl_s)
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
            temperature=temperature,
            affinity_ttl_s=affinity_ttl_s,
        )[0]
        for capacity in capacities
        for router in routers
        for policy in policies
    ]
