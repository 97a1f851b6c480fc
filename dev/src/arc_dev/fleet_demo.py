"""``make demo-fleet``: two vLLM replicas behind the real vLLM router, per routing policy.

Steps (each printed with its wall time):

1. Generate a mixed trace (Qwen-Bailian form, 32-token blocks = the servers' block size, fixed
   seeds): multi-turn conversations sharing a few system prompts, interleaved with document
   QA (Zipf over documents), both from ``arc_simulator.generate``. Predict every routing x
   eviction pair with the simulator's fleet model (``arc_simulator.fleet``, overlapping mode,
   2 replicas of the same per-replica capacity), as ``arc-evictor simulate TRACE --replicas 2
   --router R --policy P --capacity C`` would.
2. Build the small local Llama of ``make demo`` (nothing is downloaded) and start the fleet
   (``arc_harness.fleet``): two servers with the arc_evictor plugin and KV events, each with a
   cache small enough that where a request lands decides whether its prefix is cached, and
   the router.
3. For each routing entry the router is restarted with its policy and arguments (``--routing
   kv_aware:temperature=0,cache_aware:cache-threshold=0.5``, see ``parse_routing``); for each
   eviction policy the plugin switches live, every prefix cache is emptied, and the real
   Locust replays the whole trace through the router (``X-Session-ID`` on every request).
4. One big cache: the fleet stops and one server holding both servers' cache (twice the
   blocks) takes its place behind the router; each eviction policy replays the same trace at
   the same pace through it, as the ``one_cache`` row (predicted as one replica of twice the
   capacity). What a routed fleet keeps of it is every routed row's measured ``of one
   cache``: its block hit rate over this row's, same eviction policy.
5. Print one table (measured next to predicted) and write it as ``fleet.md`` and
   ``fleet.json`` under ``--out``: the summed block hit rate (the plugin's block counters over
   both replicas), TTFT p50/p90 (Locust), each replica's share of requests (vLLM's request
   counter; the table lists the shares largest first, the JSON in server order), the mean
   requests in flight per replica, and the simulator's figures. A router that draws
   (``random``, ``kv_aware`` above temperature 0) is predicted over ``PREDICTION_SEEDS``
   seeds: the mean, and the 10th to 90th percentile of the hit rate.

With ``--record-decisions`` each ``kv_aware`` replay also writes ``kv_events.jsonl`` (every
KV-event batch the servers published, with vLLM's stamp and its arrival) and ``decisions.jsonl``
(``arc_dev.fleet_decisions``: each request's router decision next to the published state it
was made from and the simulator's rule on that state); the router logs at debug level and the
servers report each request's cached prompt tokens. Each ``kv_aware`` and ``cache_aware`` row
then also carries the model's hit rate on the placement the router made ("sim on its
placement"): the model of the servers' caches alone, the router's choices given.

Invariant: a run is only reported when every request of the trace was answered; otherwise
the demo stops with exit status 1 naming the run and why. Bad arguments exit with status 2
before anything is started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Self

from arc_dev.demo import StepClock, stop_on_sigterm
from arc_dev.fleet_decisions import (
    DecisionRecordError,
    boundary_s,
    cache_aware_placement,
    join_decisions,
    predict_on_placement,
    service_times,
    summarise,
    unanchored_stores,
    write_decisions,
)
from arc_dev.fleet_decisions import describe as describe_decisions
from arc_dev.pacing import (
    TIME_SCALE_HELP,
    Pace,
    ProgressReporter,
    measure_cost,
    pace,
    parse_time_scale,
    warm_long_prompts,
    warm_up,
)
from arc_evictor.policies import policy_names
from arc_harness.fleet import (
    BLOCK_TOKENS,
    ROUTER_POLICIES,
    SERVED_MODEL,
    Fleet,
    FleetError,
    ReplicaStats,
    server_url,
)
from arc_harness.kv_events import KvBatch, KvEventRecorder, write_batches
from arc_loadtest.tokens import TokenMapper, vocabulary_from_tokenizer
from arc_serving_common.names import KV_AWARE_ROUTER_TEMPERATURE
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.fleet import simulate_fleet
from arc_simulator.generate import (
    ConversationParams,
    DocQAParams,
    GeneratedRequest,
    conversation,
    docqa,
    write_generated,
)
from arc_simulator.routing import (
    CacheAwareConfig,
    RoutingError,
    check_affinity_ttl,
    check_temperature,
)
from arc_simulator.simulate import CostModel, SimulationResult

REPLICAS = 2
DEFAULT_ROUTING = ("round_robin", "consistent_hash", "cache_aware", "kv_aware")
# LRU is the baseline; TRIO is the policy docs/evaluation.md recommends (the chart's default).
DEFAULT_EVICTION = ("lru", "trio")
DOCQA = DocQAParams(
    documents=20,
    document_tokens=700,
    questions_per_document=3.0,
    zipf_exponent=1.1,
    question_tokens=32,
    output_tokens=8,
    requests_per_second=3.0,
    seed=0,
)
CONVERSATION = ConversationParams(
    sessions=20,
    system_prompts=4,
    system_tokens=480,
    mean_turns=3.0,
    max_turns=5,
    user_tokens=64,
    output_tokens=8,
    think_time_s=1.5,
    sessions_per_second=1.2,
    seed=0,
)
CAPACITY_BLOCKS = 80  # per replica: about three documents, or two conversations and prompts
# Hidden 512, 4 layers, 8 heads: the model of ``make demo``, whose cached prefills are
# visibly faster than uncached ones on CPU.
MODEL = {"hidden_size": 512, "num_layers": 4, "num_heads": 8}
# The simulator's service times before the servers are timed (``--simulate-only``): that
# model on one 2-core machine with AMX. A run replaces them with its own.
COST = CostModel(
    prefill_seconds_per_token=0.22e-3, decode_seconds_per_token=0.008, step_seconds=0.02
)
PORT_BASE = 27400
# The routing label of the run on one server holding both replicas' caches.
ONE_CACHE = "one_cache"
# The routers whose decisions --record-decisions records (their debug logs name the worker).
RECORDED = ("kv_aware", "cache_aware")
# A router that draws is predicted over this many seeds: one draw of the model is one sample
# of a run, and on this trace the draws of kv_aware at temperature 1 spread the hit rate by
# 2 points (standard deviation) around their mean.
PREDICTION_SEEDS = 20
# Offered work per replica as a share of what one replica alone serves, if nothing hit.
# Replicas on one machine share its memory bandwidth, and the router, Locust and vLLM's own
# API processes share its cores: at 0.5 two local replicas held about two requests in
# flight each and queued (TTFT p90 0.7 to 1.5 s); at 0.25 queues stay short.
UTILIZATION = 0.25


class FleetDemoError(RuntimeError):
    """A step of the fleet demo failed; the message says which and why."""


# The arguments a ``--routing`` entry may give, by policy: kv_aware's --router-temperature and
# --kv-aware-session-affinity-ttl-secs, cache_aware's thresholds (the router's flag names).
CACHE_AWARE_FIELDS: dict[str, tuple[str, type[int] | type[float]]] = {
    "cache-threshold": ("cache_threshold", float),
    "balance-abs-threshold": ("balance_abs_threshold", int),
    "balance-rel-threshold": ("balance_rel_threshold", float),
}
CACHE_AWARE_DEFAULTS = CacheAwareConfig()
ROUTING_ARGUMENTS = {
    "kv_aware": ("temperature", "affinity-ttl"),
    "cache_aware": tuple(CACHE_AWARE_FIELDS),
}


@dataclass(frozen=True, slots=True)
class Routing:
    """One ``--routing`` entry: a router policy and the arguments it runs with, given alike to
    the real router and to the simulator's prediction.

    ``temperature`` and ``affinity_ttl_s`` are kv_aware's ``--router-temperature`` (the
    operator's by default) and ``--kv-aware-session-affinity-ttl-secs`` (None: off);
    ``cache_aware`` holds cache_aware's thresholds. Invariant: a field only another policy
    reads keeps its default, so two entries are equal exactly when they run alike.
    """

    policy: str
    temperature: float = KV_AWARE_ROUTER_TEMPERATURE
    affinity_ttl_s: int | None = None
    cache_aware: CacheAwareConfig = CACHE_AWARE_DEFAULTS

    @property
    def draws(self) -> bool:
        """Whether the router draws at random, so that one prediction is one sample."""
        return self.policy == "random" or (self.policy == "kv_aware" and self.temperature > 0)

    @property
    def label(self) -> str:
        """The entry as ``--routing`` spells it, defaults left out (``kv_aware:temperature=0``)."""
        parts = [self.policy]
        if self.temperature != KV_AWARE_ROUTER_TEMPERATURE:
            parts.append(f"temperature={self.temperature:g}")
        if self.affinity_ttl_s is not None:
            parts.append(f"affinity-ttl={self.affinity_ttl_s}")
        for flag, (field, _) in CACHE_AWARE_FIELDS.items():
            value = getattr(self.cache_aware, field)
            if value != getattr(CACHE_AWARE_DEFAULTS, field):
                parts.append(f"{flag}={value:g}")
        return ":".join(parts)

    def router_args(self) -> list[str]:
        """The router's flags beyond the fleet's own."""
        if self.policy == "kv_aware":
            args = ["--router-temperature", str(self.temperature)]
            if self.affinity_ttl_s is not None:
                args += ["--kv-aware-session-affinity-ttl-secs", str(self.affinity_ttl_s)]
            return args
        if self.policy == "cache_aware" and self.cache_aware != CACHE_AWARE_DEFAULTS:
            return self.cache_aware.router_args()
        return []


def _number(entry: str, key: str, text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise ValueError(f"--routing {entry!r}: {key} must be {noun}, got {text!r}") from None


def _routing(entry: str) -> Routing:
    name, *arguments = (part.strip() for part in entry.split(":"))
    policy = name.lower()
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"--routing: unknown policy {name!r}; valid: {', '.join(ROUTER_POLICIES)}")
    valid = ROUTING_ARGUMENTS.get(policy, ())
    values: dict[str, str] = {}
    for argument in arguments:
        key, equals, value = (part.strip() for part in argument.partition("="))
        if not equals or key not in valid or key in values:
            takes = ", ".join(f"{key}=VALUE" for key in valid) or "no arguments"
            raise ValueError(
                f"--routing {entry!r}: {argument!r} is not an argument of {policy} "
                f"(it takes {takes}, each once)"
            )
        values[key] = value
    routing = Routing(policy)
    try:
        if "temperature" in values:
            temperature = float(_number(entry, "temperature", values["temperature"], float))
            check_temperature(temperature)
            routing = replace(routing, temperature=temperature)
        if "affinity-ttl" in values:
            ttl = int(_number(entry, "affinity-ttl", values["affinity-ttl"], int))
            check_affinity_ttl(ttl)
            routing = replace(routing, affinity_ttl_s=ttl)
        thresholds = {
            field: _number(entry, flag, values[flag], kind)
            for flag, (field, kind) in CACHE_AWARE_FIELDS.items()
            if flag in values
        }
        if thresholds:
            routing = replace(routing, cache_aware=CacheAwareConfig(**thresholds))
    except RoutingError as exc:
        raise ValueError(f"--routing {entry!r}: {exc}") from None
    return routing


def parse_routing(text: str) -> tuple[Routing, ...]:
    """``--routing``'s comma-separated entries, each ``POLICY[:KEY=VALUE]...``; ValueError
    naming the entry and what is wrong with it. kv_aware takes ``temperature`` and
    ``affinity-ttl`` (seconds), cache_aware ``cache-threshold``, ``balance-abs-threshold``
    and ``balance-rel-threshold``."""
    routings = tuple(_routing(entry.strip()) for entry in text.split(",") if entry.strip())
    if not routings or len(set(routings)) != len(routings):
        raise ValueError(f"--routing needs distinct comma-separated entries, got {text!r}")
    return routings


@dataclass(frozen=True, slots=True)
class FleetDemoSettings:
    """What one run does; ``parse_args`` builds it and checks every field."""

    out: Path
    routing: tuple[Routing, ...] = tuple(Routing(policy) for policy in DEFAULT_ROUTING)
    eviction: tuple[str, ...] = DEFAULT_EVICTION
    capacity_blocks: int = CAPACITY_BLOCKS
    docqa: DocQAParams = DOCQA
    conversation: ConversationParams = CONVERSATION
    time_scale: float | None = None  # None: paced to the measured servers (arc_dev.pacing)
    port_base: int = PORT_BASE
    simulate_only: bool = False
    record_decisions: bool = False


@dataclass(frozen=True, slots=True)
class Figures:
    """One routing x eviction pair's figures, measured or predicted.

    ``shares``: each replica's share of the requests (sums to 1), in replica order; for a
    prediction over several seeds, the seeds' mean of the shares largest first.
    ``in_flight``: the requests' summed time from sending (arrival) to the last token over the
    span from the first sending to the last end, per replica (Little's law: how busy the
    replicas were). ``seeds``: the simulator runs a prediction averages (1 for a measured run);
    ``block_hit_low``/``block_hit_high`` the 10th and 90th percentile of their hit rates.
    ``decisions``: what ``DecisionRecorder.write`` returned for a recorded run
    (``--record-decisions``; ``kv_aware`` and ``cache_aware`` only), else None.
    """

    routing: str
    eviction: str
    requests: int
    block_queries: float
    block_hits: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    shares: tuple[float, ...]
    seconds: float = 0.0
    in_flight: float | None = None
    seeds: int = 1
    block_hit_low: float | None = None
    block_hit_high: float | None = None
    decisions: dict[str, Any] | None = None

    @property
    def block_hit_rate(self) -> float | None:
        return self.block_hits / self.block_queries if self.block_queries else None


# ------------------------------------------------------------------------- arguments
def _names(
    text: str, valid: Sequence[str], option: str, parser: argparse.ArgumentParser
) -> tuple[str, ...]:
    names = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in valid]
    if unknown:
        parser.error(f"{option}: unknown policy {unknown[0]!r}; valid: {', '.join(valid)}")
    if not names or len(set(names)) != len(names):
        parser.error(f"{option} needs distinct comma-separated policies, got {text!r}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> FleetDemoSettings:
    """Parse and check the command line; exits with status 2 and a message on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m arc_dev.fleet_demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("out/demo-fleet"), help="output folder")
    parser.add_argument(
        "--routing",
        default=",".join(DEFAULT_ROUTING),
        help=f"routing policies, each POLICY[:KEY=VALUE]... (default {','.join(DEFAULT_ROUTING)})"
        "; kv_aware takes temperature (default "
        f"{KV_AWARE_ROUTER_TEMPERATURE:g}, the operator's) and affinity-ttl (seconds, default "
        "off), cache_aware cache-threshold, balance-abs-threshold and balance-rel-threshold "
        "(the router's defaults): kv_aware:temperature=0,cache_aware:cache-threshold=0.5",
    )
    parser.add_argument(
        "--eviction",
        default=",".join(DEFAULT_EVICTION),
        help=f"eviction policies (default {','.join(DEFAULT_EVICTION)})",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=CAPACITY_BLOCKS,
        help=f"cacheable blocks per replica (default {CAPACITY_BLOCKS})",
    )
    parser.add_argument(
        "--sessions", type=int, default=CONVERSATION.sessions, help="conversations in the trace"
    )
    parser.add_argument(
        "--documents", type=int, default=DOCQA.documents, help="documents of the document-QA part"
    )
    parser.add_argument("--time-scale", default="auto", help=TIME_SCALE_HELP)
    parser.add_argument(
        "--port-base",
        type=int,
        default=PORT_BASE,
        help=f"first of the 100 local ports the fleet uses (default {PORT_BASE})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of both generators")
    parser.add_argument(
        "--simulate-only",
        action="store_true",
        help="print the simulator's prediction only, start nothing",
    )
    parser.add_argument(
        "--record-decisions",
        action="store_true",
        help="for each kv_aware replay, write the servers' KV events and each request's router "
        "decision next to the state it was made from (kv_events.jsonl, decisions.jsonl); for "
        "kv_aware and cache_aware, predict each run on the placement its router made",
    )
    args = parser.parse_args(argv)
    try:
        routing = parse_routing(args.routing)
    except ValueError as exc:
        parser.error(str(exc))
    eviction = _names(
        args.eviction, [n for n in policy_names() if n != "belady"], "--eviction", parser
    )
    max_model_len = 2048
    if args.capacity * BLOCK_TOKENS < max_model_len:
        parser.error(
            f"--capacity must be at least {max_model_len // BLOCK_TOKENS} blocks (one "
            f"{max_model_len}-token request must fit), got {args.capacity}"
        )
    for option, value in (("--sessions", args.sessions), ("--documents", args.documents)):
        if value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    try:
        time_scale = parse_time_scale(args.time_scale)
    except ValueError as exc:
        parser.error(str(exc))
    if not 1024 <= args.port_base <= 65435:
        parser.error(f"--port-base must be between 1024 and 65435, got {args.port_base}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    return FleetDemoSettings(
        out=args.out,
        routing=routing,
        eviction=eviction,
        capacity_blocks=args.capacity,
        docqa=replace(DOCQA, documents=args.documents, seed=args.seed),
        conversation=replace(CONVERSATION, sessions=args.sessions, seed=args.seed),
        time_scale=time_scale,
        port_base=args.port_base,
        simulate_only=args.simulate_only,
        record_decisions=args.record_decisions,
    )


# --------------------------------------------------------------------------- trace
def mixed_requests(
    docqa_params: DocQAParams, conversation_params: ConversationParams
) -> list[GeneratedRequest]:
    """Conversations and document QA interleaved by arrival time.

    Document-QA chat ids and true sessions follow the conversations' (each question is its own
    root), so every chat id is unique and every conversation keeps its ``parent_chat_id`` links.
    """
    chats = conversation(conversation_params)
    offset = max(request.chat_id for request in chats) + 1
    questions = [
        replace(request, chat_id=offset + request.chat_id, session=offset + request.session)
        for request in docqa(docqa_params)
    ]
    return sorted(chats + questions, key=lambda request: (request.timestamp_s, request.chat_id))


# --------------------------------------------------------------------- simulation
def predict(
    requests: Sequence[TraceRequest],
    routing: Sequence[Routing],
    eviction: Sequence[str],
    capacity: int,
    cost: CostModel = COST,
    port_base: int = PORT_BASE,
) -> list[Figures]:
    """The simulator's fleet of ``REPLICAS`` replicas, overlapping mode, per pair, each
    routing with its arguments; the fleet's server URLs on ``port_base`` place
    ``consistent_hash``'s ring as the router's. A routing that draws is the mean of seeds 0
    to ``PREDICTION_SEEDS - 1``, with the 10th and 90th percentile of their hit rates."""
    worker_urls = [server_url(port_base, index) for index in range(REPLICAS)]
    predictions = []
    for router in routing:
        for policy in eviction:
            results = [
                simulate_fleet(
                    requests, policy, capacity, REPLICAS, router.policy, sequential=False,
                    cost=cost, seed=seed, temperature=router.temperature,
                    cache_aware=router.cache_aware, worker_urls=worker_urls,
                    affinity_ttl_s=router.affinity_ttl_s,
                )[0]
                for seed in range(PREDICTION_SEEDS if router.draws else 1)
            ]  # fmt: skip
            predictions.append(_mean_figures(router.label, policy, results))
    return predictions


def predict_one_cache(
    requests: Sequence[TraceRequest], eviction: Sequence[str], capacity: int, cost: CostModel
) -> list[Figures]:
    """The simulator's one replica holding ``REPLICAS`` replicas' ``capacity``, per policy."""
    return [
        _mean_figures(ONE_CACHE, policy, [simulate_fleet(
            requests, policy, capacity * REPLICAS, 1, "round_robin", sequential=False, cost=cost
        )[0]])
        for policy in eviction
    ]  # fmt: skip


def _mean(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.fmean(present) if present else None


def _mean_figures(routing: str, eviction: str, results: Sequence[SimulationResult]) -> Figures:
    """One prediction from the simulator runs of one pair (one run: its own figures)."""
    if len(results) == 1:
        (result,) = results
        return Figures(
            routing, eviction, result.requests, result.block_queries, result.block_hits,
            result.ttft_p50_s, result.ttft_p90_s, tuple(result.request_shares),
            in_flight=result.mean_in_flight,
        )  # fmt: skip
    rates = sorted(result.block_hit_rate for result in results)
    low, high = statistics.quantiles(rates, n=10, method="inclusive")[::8]
    shares = [sorted(result.request_shares, reverse=True) for result in results]
    return Figures(
        routing,
        eviction,
        results[0].requests,
        statistics.fmean(result.block_queries for result in results),
        statistics.fmean(result.block_hits for result in results),
        _mean([result.ttft_p50_s for result in results]),
        _mean([result.ttft_p90_s for result in results]),
        tuple(statistics.fmean(column) for column in zip(*shares, strict=True)),
        in_flight=_mean([result.mean_in_flight for result in results]),
        seeds=len(results),
        block_hit_low=low,
        block_hit_high=high,
    )


# ------------------------------------------------------------------------ reports
def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _predicted_rate(prediction: Figures | None) -> str:
    if prediction is None:
        return "-"
    rate = _rate(prediction.block_hit_rate)
    if prediction.block_hit_low is None or prediction.block_hit_high is None:
        return rate
    return f"{rate} ({prediction.block_hit_low:.3f}-{prediction.block_hit_high:.3f})"


def _predicted_rate_of(figures: dict[str, Any]) -> str:
    return (
        f"{_rate(figures['block_hit_rate'])} "
        f"({_rate(figures['block_hit_low'])}-{_rate(figures['block_hit_high'])})"
    )


def _flight(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _shares(shares: Sequence[float]) -> str:
    # Largest first: which server the router registers first changes from one start of it
    # to the next, and its ties go to that one (the model's are replica 0's).
    return "/".join(f"{share:.2f}" for share in sorted(shares, reverse=True))


HEADER = [
    "routing",
    "eviction",
    "requests",
    "block hit",
    "sim hit",
    "sim on its placement",
    "of one cache",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "sim TTFT p50 ms",
    "shares",
    "sim shares",
    "in flight",
    "sim in flight",
]


def of_one_cache(runs: Sequence[Figures]) -> list[float | None]:
    """Each run's block hit rate over the ``one_cache`` run's of the same eviction policy
    (None where that run or a rate is missing)."""
    one = {run.eviction: run.block_hit_rate for run in runs if run.routing == ONE_CACHE}
    shares = []
    for run in runs:
        best, rate = one.get(run.eviction), run.block_hit_rate
        shares.append(rate / best if rate is not None and best else None)
    return shares


def on_placement(run: Figures) -> float | None:
    """The model's hit rate on the placement the router recorded for ``run`` (None where
    its decisions were not recorded)."""
    if run.decisions is None:
        return None
    rate: float | None = run.decisions["on_recorded_placement"]["block_hit_rate"]
    return rate


def table_rows(runs: Sequence[Figures], predictions: Sequence[Figures]) -> list[list[str]]:
    """One row per measured pair, the simulator's figures for the same pair beside it."""
    predicted = {(p.routing, p.eviction): p for p in predictions}
    rows = []
    for run, kept in zip(runs, of_one_cache(runs), strict=True):
        sim = predicted.get((run.routing, run.eviction))
        rows.append(
            [
                run.routing,
                run.eviction,
                f"{run.requests}",
                _rate(run.block_hit_rate),
                _predicted_rate(sim),
                _rate(on_placement(run)),
                "-" if kept is None else f"{kept:.2f}",
                _ms(run.ttft_p50_s),
                _ms(run.ttft_p90_s),
                _ms(sim.ttft_p50_s if sim else None),
                _shares(run.shares),
                _shares(sim.shares) if sim else "-",
                _flight(run.in_flight),
                _flight(sim.in_flight if sim else None),
            ]
        )
    return rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Aligned plain text: first column left, the rest right."""
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for number, row in enumerate(table):
        cells = [c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- runs
def _delta(
    before: Sequence[ReplicaStats], after: Sequence[ReplicaStats], field: str
) -> list[float]:
    values = []
    for first, last in zip(before, after, strict=True):
        start, end = getattr(first, field), getattr(last, field)
        if start is None or end is None:
            raise FleetDemoError(f"replica {first.index} ({first.url}) did not answer /metrics")
        values.append(end - start)
    return values


def replay_pair(
    fleet: Fleet,
    routing: str,
    eviction: str,
    trace: Path,
    out: Path,
    *,
    tokenizer: Path,
    time_scale: float,
    run_time_s: int,
    total: int,
    scheduled_s: float,
    clock: StepClock,
    record: DecisionRecorder | None = None,
) -> Figures:
    """Switch eviction live, empty the caches, replay ``trace`` through the router.

    Prints the requests the replicas have finished every 15 s while the replay runs. With
    ``record``, the servers' KV events are recorded during the replay and its decisions
    joined after it (``DecisionRecorder``).
    """
    from arc_loadtest.run import run_replay

    fleet.switch_policy(eviction)
    fleet.reset_caches()
    run_dir = out / f"{re.sub('[:=]', '-', routing)}-{eviction}"
    before = fleet.per_replica_stats()
    started = time.monotonic()

    def answered() -> int:
        return int(sum(_delta(before, fleet.per_replica_stats(), "requests")))

    log_start = fleet.router.log_path.stat().st_size if fleet.router.log_path.exists() else 0
    try:
        with (
            ProgressReporter(f"{routing}/{eviction}", total, answered,
                             scheduled_s=scheduled_s, print_line=clock.step),
            KvEventRecorder(
                [f"tcp://127.0.0.1:{server.kv_event_port}" for server in fleet.servers]
            ) if record else contextlib.nullcontext() as events,
        ):  # fmt: skip
            replay = run_replay(
                fleet.router.url,
                trace,
                out_dir=run_dir,
                run_time_s=run_time_s,
                block_tokens=BLOCK_TOKENS,
                time_scale=time_scale,
                model=SERVED_MODEL,
                tokenizer=tokenizer,
                api_key=fleet.api_key,
            )
    except subprocess.TimeoutExpired as exc:
        raise FleetDemoError(
            f"the {routing}/{eviction} replay did not finish within {exc.timeout:.0f}s"
        ) from exc
    seconds = time.monotonic() - started
    (run_dir / "locust.log").write_text(replay.log)
    summary = replay.summary
    if replay.exit_code != 0 or summary is None:
        raise FleetDemoError(
            f"the {routing}/{eviction} replay failed (Locust exit status "
            f"{replay.exit_code}); log {run_dir / 'locust.log'}, last lines:\n"
            f"{replay.log[-2000:]}"
        )
    if summary["requests_unsent"] or summary["requests_failed"]:
        raise FleetDemoError(
            f"the {routing}/{eviction} replay did not answer the whole trace: "
            f"{summary['requests_ok']} ok, {summary['requests_failed']} failed "
            f"({summary['requests_failed_in_flight']} in flight), "
            f"{summary['requests_unsent']} unsent; log {run_dir / 'locust.log'}"
        )
    after = fleet.per_replica_stats()
    if any(stats.policy != eviction for stats in after):
        raise FleetDemoError(
            f"a replica left {eviction!r} during the {routing} run: "
            f"{[stats.policy for stats in after]}"
        )
    served = _delta(before, after, "requests")
    total = sum(served)
    if total != summary["requests_ok"]:
        raise FleetDemoError(
            f"the replicas served {total:.0f} requests, Locust counted "
            f"{summary['requests_ok']} ({routing}/{eviction})"
        )
    decisions = None
    if record is not None and isinstance(events, KvEventRecorder):
        with fleet.router.log_path.open("rb") as log:
            log.seek(log_start)
            router_log = log.read().decode(errors="replace")
        decisions = record.write(run_dir, eviction, events.snapshot(), router_log)
        refit = decisions["at_measured_service_times"]
        placed = decisions["on_recorded_placement"]
        joined = f"{describe_decisions(decisions)}; " if record.routing.policy == "kv_aware" else ""
        clock.step(
            f"{routing}/{eviction}: {joined}the model at the service times measured: hit "
            f"{_predicted_rate_of(refit)}, in flight {_flight(refit['in_flight'])}; on the "
            f"router's placement: hit {_rate(placed['block_hit_rate'])}, in flight "
            f"{_flight(placed['in_flight'])}"
        )
    return Figures(
        routing,
        eviction,
        int(total),
        block_queries=sum(_delta(before, after, "block_queries")),
        block_hits=sum(_delta(before, after, "block_hits")),
        ttft_p50_s=summary["ttft_s"]["p50"],
        ttft_p90_s=summary["ttft_s"]["p90"],
        shares=tuple(count / total for count in served),
        seconds=seconds,
        in_flight=mean_in_flight(run_dir / "results.jsonl", len(fleet.servers)),
        decisions=decisions,
    )


@dataclass(frozen=True, slots=True)
class DecisionRecorder:
    """What ``--record-decisions`` joins a replay's records with: the trace at the replay's
    pace, the prompt each request was sent as (the load test's token mapping), the servers'
    URLs in order, and what the prediction needs (per-replica capacity, port base, the
    routing being replayed)."""

    requests: Sequence[TraceRequest]
    mapper: TokenMapper
    worker_urls: Sequence[str]
    capacity: int
    port_base: int
    routing: Routing = Routing("kv_aware")

    @classmethod
    def for_fleet(
        cls,
        fleet: Fleet,
        requests: Sequence[TraceRequest],
        tokenizer: Path,
        settings: FleetDemoSettings,
    ) -> Self:
        # The replay's own mapping: run_replay's default seed, the fleet's block size.
        vocabulary = vocabulary_from_tokenizer(tokenizer)
        mapper = TokenMapper(vocabulary, seed=0, block_tokens=BLOCK_TOKENS)
        urls = [server.url for server in fleet.servers]
        return cls(requests, mapper, urls, settings.capacity_blocks, settings.port_base)

    def write(
        self, run_dir: Path, eviction: str, batches: Sequence[KvBatch], router_log: str
    ) -> dict[str, Any]:
        """Write ``kv_events.jsonl`` (and for ``kv_aware``, ``decisions.jsonl``) into
        ``run_dir``; return the decisions' summary (``cache_aware``: their count), with the
        model's prediction at the service times the replay measured
        (``fleet_decisions.service_times``) and on the placement the router recorded."""
        write_batches(run_dir / "kv_events.jsonl", batches)
        rows = [
            json.loads(line)
            for line in (run_dir / "results.jsonl").read_text().splitlines()
            if line.strip()
        ]
        try:
            if self.routing.policy == "kv_aware":
                decisions = join_decisions(
                    self.requests,
                    lambda request: self.mapper.prompt(request.hash_ids, request.input_length),
                    rows, router_log, batches, self.worker_urls, BLOCK_TOKENS,
                )  # fmt: skip
                write_decisions(run_dir / "decisions.jsonl", decisions)
                summary = summarise(decisions) | {
                    "boundary_s": boundary_s(batches),
                    "unanchored_stores": unanchored_stores(batches),
                }
                placement = {d.index: d.worker for d in decisions}
                new_tokens = {d.index: d.router_new_tokens for d in decisions}
            else:
                placement = cache_aware_placement(rows, router_log, self.worker_urls)
                summary = {"decisions": len(placement)}
                new_tokens = {
                    row["index"]: row["input_tokens"] - row["cached_tokens"]
                    for row in rows
                    if row["ok"] and row.get("cached_tokens") is not None
                }
            measured = service_times(new_tokens, rows)
        except DecisionRecordError as exc:
            raise FleetDemoError(f"the decisions of {run_dir} do not join: {exc}") from exc
        (prediction,) = predict(
            self.requests, [self.routing], [eviction], self.capacity, measured, self.port_base
        )
        placed = predict_on_placement(
            self.requests, placement, eviction, self.capacity, len(self.worker_urls), measured
        )
        return summary | {
            "at_measured_service_times": {
                "cost_model": asdict(measured),
                "block_hit_rate": prediction.block_hit_rate,
                "block_hit_low": prediction.block_hit_low,
                "block_hit_high": prediction.block_hit_high,
                "in_flight": prediction.in_flight,
            },
            "on_recorded_placement": {
                "block_hit_rate": placed.block_hit_rate,
                "in_flight": placed.mean_in_flight,
                "shares": list(placed.request_shares),
            },
        }


def mean_in_flight(results: Path, replicas: int) -> float | None:
    """Mean requests in flight per replica over a replay, from its per-request rows."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    answered = [row for row in rows if row["ok"]]
    if not answered:
        return None
    start = min(row["sent_s"] for row in answered)
    end = max(row["sent_s"] + row["e2e_s"] for row in answered)
    busy = sum(row["e2e_s"] for row in answered)
    return busy / (end - start) / replicas if end > start else None


def write_reports(
    out: Path,
    settings: FleetDemoSettings,
    runs: Sequence[Figures],
    predictions: Sequence[Figures],
    seconds: float,
    replay_pace: Pace,
    cost: CostModel,
) -> str:
    """Write ``fleet.md`` and ``fleet.json``; return the text table."""
    rows = table_rows(runs, predictions)
    (out / "fleet.md").write_text(markdown_table(HEADER, rows) + "\n")
    report: dict[str, Any] = {
        "settings": {
            "routing": [routing.label for routing in settings.routing],
            "eviction": list(settings.eviction),
            "replicas": REPLICAS,
            "capacity_blocks_per_replica": settings.capacity_blocks,
            "router_args": {routing.label: routing.router_args() for routing in settings.routing},
            "docqa": asdict(settings.docqa),
            "conversation": asdict(settings.conversation),
            "time_scale": replay_pace.time_scale,
            "utilization_per_replica": replay_pace.utilization,
            "cost_model": asdict(cost),
            "model": MODEL,
        },
        "runs": [
            asdict(run) | {"block_hit_rate": run.block_hit_rate, "of_one_cache": kept}
            for run, kept in zip(runs, of_one_cache(runs), strict=True)
        ],
        "predictions": [asdict(p) | {"block_hit_rate": p.block_hit_rate} for p in predictions],
        "seconds": seconds,
    }
    (out / "fleet.json").write_text(json.dumps(report, indent=2) + "\n")
    return text_table(HEADER, rows)


def warm_every_server(fleet: Fleet) -> None:
    """The first long prompts of each server process, served untimed."""
    for server in fleet.servers:
        warm_long_prompts(partial(fleet.complete, url=server.url))


def pace_to_fleet(
    fleet: Fleet, requests: Sequence[TraceRequest], settings: FleetDemoSettings, clock: StepClock
) -> tuple[Pace, CostModel, list[Figures]]:
    """Warm every replica up, time the first, choose the replay's speed, and predict at that
    speed.

    The pace assumes no hit at all (round robin on this trace gets few), so no routing's run
    overloads the replicas; ``--time-scale`` overrides the speed only.
    """
    warm_every_server(fleet)
    prompt_tokens = max(sum(r.input_length for r in requests) // len(requests), 2 * BLOCK_TOKENS)
    first, *others = fleet.servers
    for server in others:  # measure_cost warms the first up itself
        warm_up(partial(fleet.complete, url=server.url), prompt_tokens)
    calibration = measure_cost(partial(fleet.complete, url=first.url), prompt_tokens)
    cost = calibration.cost_model()
    fleet.reset_caches()
    chosen = pace(
        requests,
        cost,
        0.0,
        servers=REPLICAS,
        utilization=UTILIZATION,
        time_scale=settings.time_scale,
    )
    clock.step(
        f"replica timed: {calibration.describe()}; replay at time scale "
        f"{chosen.time_scale:.2f} ({chosen.duration_s:.0f} s, each replica busy about "
        f"{100 * chosen.utilization:.0f}% of it if nothing hit)"
    )
    scaled = [replace(r, timestamp_s=r.timestamp_s * chosen.time_scale) for r in requests]
    predictions = predict(scaled, settings.routing, settings.eviction, settings.capacity_blocks,
                          cost, settings.port_base)  # fmt: skip
    clock.step("simulator predictions at that pace done")
    return chosen, cost, predictions


def describe_run(run: Figures) -> str:
    return (
        f"{run.routing}/{run.eviction}: block hit {_rate(run.block_hit_rate)}, TTFT p50 "
        f"{_ms(run.ttft_p50_s)} ms, shares {_shares(run.shares)} ({run.seconds:.0f} s)"
    )


def _router_args(routing: Routing, record: bool) -> list[str]:
    """The router's flags for ``routing``; recording logs each decision (debug)."""
    args = routing.router_args()
    return [*args, "--log-level", "debug"] if record and routing.policy in RECORDED else args


def run_demo(settings: FleetDemoSettings) -> int:
    """The whole demo (see the module docstring); returns the exit status."""
    from arc_harness.tinymodel import build_tiny_llama
    from arc_harness.vllm_server import VllmServerError

    clock = StepClock()
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "mixed.jsonl"
    write_generated(
        trace_path, mixed_requests(settings.docqa, settings.conversation), "bailian", BLOCK_TOKENS
    )
    requests = load_trace(trace_path, block_tokens=BLOCK_TOKENS)
    duration = requests[-1].timestamp_s - requests[0].timestamp_s
    distinct = len({key for request in requests for key in request.keys})
    clock.step(
        f"trace {trace_path}: {len(requests)} requests over {duration:.0f} s "
        f"({settings.conversation.sessions} conversations, {settings.docqa.documents} "
        f"documents), {distinct} distinct blocks; {REPLICAS} replicas of "
        f"{settings.capacity_blocks} blocks"
    )
    if settings.simulate_only:
        scaled = [replace(r, timestamp_s=r.timestamp_s * (settings.time_scale or 1.0))
                  for r in requests]  # fmt: skip
        predictions = predict(scaled, settings.routing, settings.eviction, settings.capacity_blocks,
                              port_base=settings.port_base)  # fmt: skip
        predictions += predict_one_cache(scaled, settings.eviction, settings.capacity_blocks, COST)
        header = ["routing", "eviction", "sim hit", "sim TTFT p50 ms", "sim TTFT p90 ms",
                  "sim shares"]  # fmt: skip
        rows = [[p.routing, p.eviction, _predicted_rate(p), _ms(p.ttft_p50_s),
                 _ms(p.ttft_p90_s), _shares(p.shares)] for p in predictions]  # fmt: skip
        print(text_table(header, rows))
        return 0
    model_dir = build_tiny_llama(out / "model", **MODEL)
    record = settings.record_decisions
    # Each request's cached prompt tokens in its answer: what the decisions record serves.
    server_args = ["--enable-prompt-tokens-details"] if record else []
    fleet = Fleet(
        model_dir,
        work_dir=out / "fleet",
        replicas=REPLICAS,
        policy=settings.routing[0].policy,
        eviction=settings.eviction[0],
        capacity_blocks=settings.capacity_blocks,
        port_base=settings.port_base,
        server_args=server_args,
        router_args=_router_args(settings.routing[0], record),
    )
    # Started once the fleet has stopped, on the same ports.
    one_cache = Fleet(
        model_dir,
        work_dir=out / "one-cache",
        replicas=1,
        policy="round_robin",
        eviction=settings.eviction[0],
        capacity_blocks=settings.capacity_blocks * REPLICAS,
        port_base=settings.port_base,
        server_args=server_args,
    )
    runs: list[Figures] = []
    try:
        with fleet:
            clock.step(
                f"fleet up: servers {[s.url for s in fleet.servers]}, router "
                f"{fleet.router.url} (logs {fleet.work_dir})"
            )
            replay_pace, cost, predictions = pace_to_fleet(fleet, requests, settings, clock)
            scaled = [
                replace(r, timestamp_s=r.timestamp_s * replay_pace.time_scale) for r in requests
            ]
            predictions += predict_one_cache(
                scaled, settings.eviction, settings.capacity_blocks, cost
            )
            recorder = (
                DecisionRecorder.for_fleet(fleet, scaled, model_dir, settings) if record else None
            )

            def replay(
                on: Fleet, routing: str, eviction: str, recording: DecisionRecorder | None = None
            ) -> None:
                run = replay_pair(
                    on,
                    routing,
                    eviction,
                    trace_path,
                    out,
                    tokenizer=model_dir,
                    time_scale=replay_pace.time_scale,
                    run_time_s=replay_pace.deadline_s(),
                    total=len(requests),
                    scheduled_s=replay_pace.duration_s,
                    clock=clock,
                    record=recording,
                )
                runs.append(run)
                clock.step(describe_run(run))

            for routing in settings.routing:
                args = _router_args(routing, record)
                if (fleet.router.policy, fleet.router.extra_args) != (routing.policy, args):
                    fleet.router.restart(routing.policy, args)
                for eviction in settings.eviction:
                    recording = (
                        replace(recorder, routing=routing)
                        if recorder and routing.policy in RECORDED
                        else None
                    )
                    replay(fleet, routing.label, eviction, recording)
        with one_cache:
            clock.step(
                f"one big cache up: one server of {settings.capacity_blocks * REPLICAS} blocks "
                f"{one_cache.servers[0].url} behind the router (logs {one_cache.work_dir})"
            )
            warm_every_server(one_cache)
            for eviction in settings.eviction:
                replay(one_cache, ONE_CACHE, eviction)
    except (VllmServerError, FleetError, FleetDemoError) as exc:
        print(f"error: {exc}\nlogs: {out}", file=sys.stderr)
        return 1
    table = write_reports(out, settings, runs, predictions, clock.elapsed(), replay_pace, cost)
    clock.step(f"done; {out / 'fleet.md'}, {out / 'fleet.json'}")
    print()
    print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    stop_on_sigterm()
    return run_demo(settings)


__all__ = [
    "Figures",
    "FleetDemoSettings",
    "main",
    "mean_in_flight",
    "mixed_requests",
    "parse_routing",
    "predict",
]

if __name__ == "__main__":
    sys.exit(main())
