"""Request routers for a fleet of vLLM replicas, modelled on the vLLM router.

Each router picks the replica for one request from what a router in front of the
fleet can know at that moment, handed to it as a ``FleetView``: the simulated
clock, each replica's load (requests routed to it and not yet finished, the
router's ``Worker::load``) and, for ``kv_aware`` only, each replica's cached
prefix as vLLM's KV-cache events have reported it and which requests routed to
it are still in prefill, and the request's ``X-Session-ID`` header (set by the client,
which knows the whole trace). Routers never see later requests.

The rules follow the vLLM router's policies (repository vllm-project/router,
``src/policies/*.rs``; defaults from its ``vllm-router`` command line, ``src/main.rs``):

- ``random``: a uniform draw from a ``random.Random`` seeded with ``seed``.
- ``round_robin``: replicas 0, 1, ..., N-1, 0, ... in request order.
- ``consistent_hash`` (``consistent_hash.rs``): a ring of 160 virtual nodes per
  replica (``<worker URL>:<v>``); a request goes to the first virtual node at or
  after its session key's hash, wrapping around, with the router's own hash
  (FurcHash and MurmurHash64A, ``arc_simulator.ring_hash``). Given the router's
  worker URLs, every assignment is the router's; without them (a cluster's are pod
  addresses) the URLs are ``default_worker_urls``, the same rule on other points.
  The session key stands in for the
  router's ``X-Session-ID`` header and is the one the load test sends
  (``arc_serving_common.sessions``): the conversation's root chat id where the
  trace links turns (``parent_chat_id``), else the conversation found from the
  trace's tree of full blocks, so conversations that only share an opening (a
  system prompt) are different sessions.
- ``cache_aware`` (``cache_aware.rs``, the approximate policy): the fleet is
  imbalanced when ``max_load - min_load > balance_abs_threshold`` and
  ``max_load > min_load * balance_rel_threshold``; then the request goes to the
  least-loaded replica. Otherwise the router matches the request against its
  own prefix tree of the requests it routed (not the replicas' caches): if the
  matched share of the prompt exceeds ``cache_threshold`` the request goes to
  the replica that owns the deepest matched node, else to the least-loaded one.
  Either way the chosen replica is recorded in the tree. Every
  ``eviction_interval_s`` of trace time, each replica's part of the tree is cut
  back to ``max_tree_tokens``, least recently used leaves first. The router's
  tree holds characters; this model holds blocks and counts their tokens, with
  the router's 2**26-character cap read as 2**24 tokens (about four characters
  a token). At a node several replicas share, the router takes whichever its map
  yields first; this model takes the one that reached it last.
- ``kv_aware`` (vllm-router 0.1.17, ``src/policies/kv_aware.rs`` of its source
  distribution on PyPI: ``MultiplicativeScorer``, ``TemperaturePicker``; ``prefix_cost``
  here): for each replica i, in registry order, c_i is the
  longest run of the request's leading blocks that the router's KV-event index
  credits to i, capped so that at least one prompt token is still computed; the
  request's new prefill tokens there are ``new_i = prompt - c_i * block``, and
  its cost is ``(new_i + Q_i) * (R_i + 1)``, with Q_i the prefill tokens the
  router has in flight on i (its own ``new`` of each request routed there whose
  prefill has not completed) and R_i the replica's load (the router takes the
  larger of its own count and the worker's report; the model's load, requests
  routed and not finished, is never below the report). With temperature 0 (the
  router's default ``--router-temperature``) the first replica of least cost
  wins; above 0 the replica is drawn with probability proportional to
  ``exp(-(cost_i - min_cost) / temperature)`` from a ``random.Random`` seeded
  with ``seed``. The index holds only what ``BlockStored``/``BlockRemoved``
  events reported, no speculative entries: vLLM publishes a block after the
  engine step that computed it, which this model places at the end of the
  prefill that computed it (``Replica.published_prefix``); a removal counts at
  once. Offloaded tiers, which the router discounts, do not arise: the plugin
  publishes GPU blocks only. The router's index skips a ``BlockStored`` whose parent it
  never saw stored (``src/kv_index/indexer.rs``); with caches emptied before the router
  subscribes that never happens (``arc_dev.fleet_decisions.unanchored_stores``), and the
  model does not model it.
  With ``affinity_ttl_s`` (the router's ``--kv-aware-session-affinity-ttl-secs``, off by
  default) a request whose session (its ``X-Session-ID``, the load test's session key) was
  routed within that many seconds goes where the session's last request went, whatever the
  costs; the session's first request, and one after a longer pause, takes the cost rule.
  Measured on the real router: with the TTL set, twelve cold prompts of one session all went
  to one server where distinct sessions split, and a session stayed on its server when the
  other one held the prompt's 256-token prefix.

Ties go where the router's Rust iterators send them: ``min_by_key`` (least load,
least cost) takes the lowest replica index.

One router here is a proposal, not a vllm-router policy:

- ``bounded_prefix``: prefix affinity with a bounded share of the requests. A replica is
  open while it took fewer than ``(1 + load_bound) / N`` of the last ``WINDOW_PER_REPLICA *
  N`` requests routed (bounded loads, Mirrokni, Thorup and Zadimoghaddam, SODA'18, over a
  window of requests rather than requests in flight, which at a few in flight per replica
  would close a holder as soon as it runs one); at least one always is. Among the open
  replicas the request goes to the longest prefix their KV events report cached
  (``kv_aware``'s credit), and among equal prefixes to the highest rendezvous hash of the
  request's first block key and the replica, so a prompt nobody holds goes where the others
  that open alike went, while that replica is open.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from arc_serving_common.names import MAX_SESSION_AFFINITY_TTL_S
from arc_serving_common.sessions import crowded_session_warning, session_keys
from arc_serving_common.traces import TraceRequest
from arc_simulator.ring_hash import fbi_hash

MAX_REPLICAS = 1024  # far above any study here; a typo like 100000 is an error, not hours


class RoutingError(ValueError):
    """A router name or fleet size that cannot be used."""


class FleetView(Protocol):
    """What a router may know when it places a request."""

    @property
    def now(self) -> float:
        """The request's arrival time, seconds."""
        ...

    @property
    def loads(self) -> Sequence[int]:
        """Requests routed to each replica and not yet finished."""
        ...

    def cached_prefix(self, replica: int, keys: Sequence[int]) -> int:
        """Blocks of ``keys``' prefix the replica's KV events have reported as cached by now."""
        ...

    def prefilling(self, replica: int) -> Collection[int]:
        """Trace indexes of the requests routed to the replica whose prefill has not
        completed by now (queued ones included)."""
        ...

    def session_id(self, request: TraceRequest) -> str:
        """The request's ``X-Session-ID`` header: its conversation's key over the whole
        trace (``arc_serving_common.sessions``), which the client, not the router, knows."""
        ...


class Router(Protocol):
    name: str

    def route(self, request: TraceRequest, view: FleetView) -> int:
        """The replica (0 to N-1) that serves ``request``."""
        ...


def _least_loaded(loads: Sequence[int]) -> int:
    """Rust's ``min_by_key``: the first replica with the smallest load."""
    return min(range(len(loads)), key=loads.__getitem__)


class RandomRouter:
    """A seeded uniform draw per request."""

    name = "random"

    def __init__(self, replicas: int, seed: int = 0) -> None:
        self._replicas = replicas
        self._rng = random.Random(seed)

    def route(self, request: TraceRequest, view: FleetView) -> int:
        return self._rng.randrange(self._replicas)


class RoundRobinRouter:
    """Replicas in turn, in request order."""

    name = "round_robin"

    def __init__(self, replicas: int, seed: int = 0) -> None:
        self._replicas = replicas
        self._next = 0

    def route(self, request: TraceRequest, view: FleetView) -> int:
        chosen = self._next
        self._next = (chosen + 1) % self._replicas
        return chosen


# vllm-router 0.1.17 hashes the header's name with its value (its log:
# ``Consistent hash routing: key='header:x-session-id:chat:57'``).
SESSION_HEADER_KEY = "header:x-session-id:"


class ConsistentHashRouter:
    """The router's hash ring over session keys (``arc_simulator.ring_hash``).

    Invariant: ``_points`` is sorted and ``_owners[i]`` owns ``_points[i]``; a point two
    workers' virtual nodes share belongs to the later worker, as in the router's map.
    """

    name = "consistent_hash"
    VIRTUAL_NODES = 160  # the router's VIRTUAL_NODES_PER_WORKER

    def __init__(
        self, replicas: int, seed: int = 0, worker_urls: Sequence[str] | None = None
    ) -> None:
        urls = list(worker_urls) if worker_urls is not None else default_worker_urls(replicas)
        if len(urls) != replicas:
            raise RoutingError(f"{len(urls)} worker URLs given for {replicas} replicas")
        ring = {
            fbi_hash(f"{url}:{node}"): replica
            for replica, url in enumerate(urls)
            for node in range(self.VIRTUAL_NODES)
        }
        self._points = sorted(ring)
        self._owners = [ring[point] for point in self._points]

    def worker_for_key(self, key: str) -> int:
        """The replica whose virtual node is the first at or after ``key``'s hash."""
        position = bisect_left(self._points, fbi_hash(key))
        return self._owners[position % len(self._points)]

    def route(self, request: TraceRequest, view: FleetView) -> int:
        return self.worker_for_key(SESSION_HEADER_KEY + view.session_id(request))


def default_worker_urls(replicas: int) -> list[str]:
    """Worker URLs for a fleet whose real ones are not given (a cluster's are pod addresses)."""
    return [f"http://replica-{replica}:8000" for replica in range(replicas)]


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """The ``vllm-router`` command's defaults for ``--policy cache_aware``."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_tokens: int = 2**26 // 4

    def __post_init__(self) -> None:
        # Named by the router's flags. Outside these bounds a threshold means nothing: the
        # cache threshold is a share of the prompt, the absolute one is an unsigned load
        # difference in the router, and below 1 the relative test holds for any load.
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise RoutingError(
                f"--cache-threshold must be between 0 and 1, got {self.cache_threshold}"
            )
        if self.balance_abs_threshold < 0:
            raise RoutingError(
                f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}"
            )
        if not (math.isfinite(self.balance_rel_threshold) and self.balance_rel_threshold >= 1):
            raise RoutingError(
                f"--balance-rel-threshold must be a number >= 1, got {self.balance_rel_threshold}"
            )

    def router_args(self) -> list[str]:
        """The ``vllm-router`` flags that give the real router these thresholds."""
        return [
            "--cache-threshold",
            str(self.cache_threshold),
            "--balance-abs-threshold",
            str(self.balance_abs_threshold),
            "--balance-rel-threshold",
            str(self.balance_rel_threshold),
        ]


class CacheAwareRouter:
    """The router's approximate prefix tree, over block keys.

    A node is a block key (a chain key names its whole prefix, so its parent is
    the previous key of any request holding it). Invariants: ``_owners[key]``
    maps each replica that was sent a request through ``key`` to the last time it
    was; ``_tokens[r]`` is the tokens of the nodes replica ``r`` owns.
    """

    name = "cache_aware"

    def __init__(
        self, replicas: int, seed: int = 0, config: CacheAwareConfig | None = None
    ) -> None:
        self.config = config or CacheAwareConfig()
        self._owners: dict[int, dict[int, float]] = {}
        self._depth: dict[int, int] = {}
        self._block_tokens: dict[int, int] = {}
        self._tokens = [0] * replicas
        self._next_eviction = self.config.eviction_interval_s

    def route(self, request: TraceRequest, view: FleetView) -> int:
        config = self.config
        now = view.now
        while now >= self._next_eviction:
            self._evict()
            self._next_eviction += config.eviction_interval_s
        loads = view.loads
        low, high = min(loads), max(loads)
        keys = request.keys
        if high - low > config.balance_abs_threshold and high > low * config.balance_rel_threshold:
            chosen = _least_loaded(loads)
        else:
            matched = 0
            while matched < len(keys) and keys[matched] in self._owners:
                matched += 1
            rate = matched / len(keys) if keys else 0.0
            if rate > config.cache_threshold:
                owners = self._owners[keys[matched - 1]]
                chosen = max(owners, key=owners.__getitem__)
            else:
                chosen = _least_loaded(loads)
        self._insert(keys, request.block_tokens, chosen, now)
        return chosen

    def _insert(self, keys: Sequence[int], block_tokens: int, replica: int, now: float) -> None:
        for depth, key in enumerate(keys):
            owners = self._owners.setdefault(key, {})
            if replica not in owners:
                self._tokens[replica] += block_tokens
                self._depth[key] = depth
                self._block_tokens[key] = block_tokens
            owners[replica] = now

    def _evict(self) -> None:
        limit = self.config.max_tree_tokens
        for replica, size in enumerate(self._tokens):
            if size <= limit:
                continue
            # Oldest first, deepest first among equals: a leaf goes before its parent,
            # whose last use is never older than its children's.
            owned = sorted(
                (owners[replica], -self._depth[key], key)
                for key, owners in self._owners.items()
                if replica in owners
            )
            for _, _, key in owned:
                if self._tokens[replica] <= limit:
                    break
                owners = self._owners[key]
                del owners[replica]
                self._tokens[replica] -= self._block_tokens[key]
                if not owners:
                    del self._owners[key]


def credited_blocks(cached: int, input_length: int, block: int) -> int:
    """The blocks of a prompt's cached prefix the router credits: at most
    ``(input_length - 1) // block``, so the last prompt token is always computed."""
    return min(cached, max(input_length - 1, 0) // block)


def prefix_cost(new_tokens: int, in_flight_tokens: int, load: int) -> int:
    """vllm-router 0.1.17's ``MultiplicativeScorer``: the new prefill tokens plus those in
    flight on the replica, times its running requests plus the one being placed."""
    return (new_tokens + in_flight_tokens) * (load + 1)


class KvAwareRouter:
    """vllm-router 0.1.17's prefix cost: new prefill tokens plus those in flight, times
    the requests running plus one; with ``affinity_ttl_s``, sessions stay where they went.

    Invariants: ``_in_flight[r]`` maps the trace index of each request routed to
    replica ``r`` whose prefill had not completed at the last decision to the
    prefill tokens this router counted for it (its ``new`` there). ``_affinity`` maps
    each session routed so far to the replica and arrival time of its last request, and
    is empty without ``affinity_ttl_s``.
    """

    name = "kv_aware"

    def __init__(
        self,
        replicas: int,
        seed: int = 0,
        temperature: float = 0.0,
        affinity_ttl_s: int | None = None,
    ) -> None:
        check_temperature(temperature)
        check_affinity_ttl(affinity_ttl_s)
        self._replicas = replicas
        self.temperature = temperature
        self.affinity_ttl_s = affinity_ttl_s
        self._rng = random.Random(seed)
        self._in_flight: list[dict[int, int]] = [{} for _ in range(replicas)]
        self._affinity: dict[str, tuple[int, float]] = {}

    def costs(self, request: TraceRequest, view: FleetView) -> list[tuple[int, int]]:
        """Each replica's (cost, new prefill tokens) for ``request``, in registry order;
        settles the prefills that completed since the last decision."""
        keys = request.keys
        block = request.block_tokens
        loads = view.loads
        scored = []
        for replica in range(self._replicas):
            cached = view.cached_prefix(replica, keys) if keys else 0
            credited = credited_blocks(cached, request.input_length, block)
            new = request.input_length - credited * block
            in_flight = self._in_flight[replica]
            if in_flight:
                prefilling = view.prefilling(replica)
                for index in [index for index in in_flight if index not in prefilling]:
                    del in_flight[index]
            scored.append((prefix_cost(new, sum(in_flight.values()), loads[replica]), new))
        return scored

    def route(self, request: TraceRequest, view: FleetView) -> int:
        if self._replicas == 1:
            return 0  # the router skips scoring for a single worker
        scored = self.costs(request, view)
        if self.affinity_ttl_s is None:
            chosen = self._least_cost(scored)
        else:
            session = view.session_id(request)
            held = self._affinity.get(session)
            if held is not None and view.now - held[1] <= self.affinity_ttl_s:
                chosen = held[0]
            else:
                chosen = self._least_cost(scored)
            self._affinity[session] = (chosen, view.now)
        self._in_flight[chosen][request.index] = scored[chosen][1]
        return chosen

    def _least_cost(self, scored: Sequence[tuple[int, int]]) -> int:
        least = min(cost for cost, _ in scored)
        if self.temperature == 0:
            return next(r for r, (cost, _) in enumerate(scored) if cost == least)
        weights = [math.exp(-(cost - least) / self.temperature) for cost, _ in scored]
        return self._rng.choices(range(self._replicas), weights)[0]


DEFAULT_LOAD_BOUND = 0.1
WINDOW_PER_REPLICA = 64


class BoundedPrefixRouter:
    """The longest published prefix among the replicas under their share of recent requests
    (see the module docstring); ``load_bound`` is epsilon, the share above 1/N a replica may
    take of the window.

    Invariant: ``_recent`` holds the replicas of the last ``_recent.maxlen`` decisions, and
    ``_counts[r]`` how many of them went to ``r``.
    """

    name = "bounded_prefix"

    def __init__(
        self, replicas: int, seed: int = 0, load_bound: float = DEFAULT_LOAD_BOUND
    ) -> None:
        check_load_bound(load_bound)
        self._replicas = replicas
        self.load_bound = load_bound
        self._recent: deque[int] = deque(maxlen=WINDOW_PER_REPLICA * replicas)
        self._counts = [0] * replicas

    def route(self, request: TraceRequest, view: FleetView) -> int:
        if self._replicas == 1:
            return 0  # as kv_aware: one replica keeps nothing for a router to read
        share = (1 + self.load_bound) * max(len(self._recent), 1) / self._replicas
        open_replicas = [r for r in range(self._replicas) if self._counts[r] < share]
        keys = request.keys
        if keys:
            chosen = max(
                open_replicas,
                key=lambda replica: (
                    view.cached_prefix(replica, keys),
                    _rendezvous(keys[0], replica),
                ),
            )
        else:
            chosen = min(open_replicas, key=view.loads.__getitem__)
        if len(self._recent) == self._recent.maxlen:
            self._counts[self._recent[0]] -= 1
        self._recent.append(chosen)
        self._counts[chosen] += 1
        return chosen


def _rendezvous(key: int, replica: int) -> int:
    digest = hashlib.blake2b(f"{key}:{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def check_load_bound(load_bound: float) -> None:
    if not (math.isfinite(load_bound) and load_bound >= 0):
        raise RoutingError(f"the load bound must be a finite number >= 0, got {load_bound}")


def check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RoutingError(f"--router-temperature must be a finite number >= 0, got {temperature}")


def check_affinity_ttl(ttl_s: int | None) -> None:
    if ttl_s is not None and not (
        isinstance(ttl_s, int) and 1 <= ttl_s <= MAX_SESSION_AFFINITY_TTL_S
    ):
        raise RoutingError(
            "the session affinity TTL must be whole seconds from 1 to "
            f"{MAX_SESSION_AFFINITY_TTL_S}, got {ttl_s}"
        )


RouterFactory = Callable[[int, int], Router]
ROUTERS: dict[str, RouterFactory] = {
    "random": RandomRouter,
    "round_robin": RoundRobinRouter,
    "consistent_hash": ConsistentHashRouter,
    "cache_aware": CacheAwareRouter,
    "kv_aware": KvAwareRouter,
    "bounded_prefix": BoundedPrefixRouter,
}


# The proposal is the simulator's own; a study of the vLLM router's policies leaves it out.
PROPOSALS = ("bounded_prefix",)


def uses_sessions(name: str, affinity_ttl_s: int | None = None) -> bool:
    """Whether router ``name`` keeps a session on one replica (keys on ``X-Session-ID``)."""
    router = name.strip().lower()
    return router == ConsistentHashRouter.name or (
        router == KvAwareRouter.name and affinity_ttl_s is not None
    )


def crowded_session(
    requests: Sequence[TraceRequest],
    trace: str,
    routers: Sequence[str],
    affinity_ttl_s: int | None = None,
) -> str | None:
    """``crowded_session_warning`` for a run of ``routers`` on ``requests`` (trace ``trace``);
    None unless one of them keeps a session on one replica."""
    if not any(uses_sessions(name, affinity_ttl_s) for name in routers):
        return None
    return crowded_session_warning(session_keys(requests), trace)


def router_names() -> list[str]:
    return list(ROUTERS)


def vllm_router_names() -> list[str]:
    """The routers that model a vllm-router policy."""
    return [name for name in ROUTERS if name not in PROPOSALS]


def check_replicas(replicas: int) -> None:
    if not 1 <= replicas <= MAX_REPLICAS:
        raise RoutingError(f"replicas must be between 1 and {MAX_REPLICAS}, got {replicas}")


def check_router(
    name: str, replicas: int, temperature: float = 0.0, affinity_ttl_s: int | None = None
) -> RouterFactory:
    """The factory of router ``name`` (case and surrounding blanks ignored) after the checks
    ``make_router`` makes, or RoutingError naming the problem; nothing is built, since a
    ``consistent_hash`` ring costs milliseconds."""
    check_replicas(replicas)
    check_temperature(temperature)
    check_affinity_ttl(affinity_ttl_s)
    factory = ROUTERS.get(name.strip().lower())
    if factory is None:
        raise RoutingError(f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}")
    return factory


def make_router(
    name: str,
    replicas: int,
    seed: int = 0,
    temperature: float = 0.0,
    cache_aware: CacheAwareConfig | None = None,
    worker_urls: Sequence[str] | None = None,
    affinity_ttl_s: int | None = None,
    load_bound: float = DEFAULT_LOAD_BOUND,
) -> Router:
    """A fresh router by registry name for ``replicas`` replicas.

    ``temperature`` is vllm-router's ``--router-temperature`` and ``affinity_ttl_s`` its
    ``--kv-aware-session-affinity-ttl-secs``, which only ``kv_aware`` reads; they are
    checked for every router, so a bad value is refused whatever the name.
    ``cache_aware`` holds ``cache_aware``'s thresholds (the router's defaults if None);
    ``worker_urls`` the router's ``--worker-urls``, which place ``consistent_hash``'s ring;
    ``load_bound`` is ``bounded_prefix``'s epsilon.
    """
    factory = check_router(name, replicas, temperature, affinity_ttl_s)
    if factory is KvAwareRouter:
        return KvAwareRouter(replicas, seed, temperature, affinity_ttl_s)
    if factory is CacheAwareRouter:
        return CacheAwareRouter(replicas, seed, cache_aware)
    if factory is ConsistentHashRouter:
        return ConsistentHashRouter(replicas, seed, worker_urls)
    if factory is BoundedPrefixRouter:
        return BoundedPrefixRouter(replicas, seed, load_bound)
    return factory(replicas, seed)
