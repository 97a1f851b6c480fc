"""Each ``kv_aware`` decision of a fleet-demo replay, next to the state it was made from.

One replay gives four records, joined here request by request:

- the trace, and the prompt token ids the load test sent for each request (``TokenMapper``);
- the replay's rows (``results.jsonl``): when each request was sent, its first token and last
  token arrived, and the prompt tokens the serving vLLM found cached (``cached_tokens``, with
  ``--enable-prompt-tokens-details``);
- the router's debug log: vllm-router 0.1.17 logs one ``KV prefix decision`` per request it
  scores, with the worker it chose, the prompt's tokens, the new prefill tokens it counted and
  the prefix tokens it credited to that worker;
- the KV-event batches each server published, each at the time vLLM stamped it
  (``arc_harness.kv_events``; the router receives a batch moments after, while the recorder,
  a thread of a busy Python process, can take a second longer).

For every decision the row holds what each server had published as cached for the prompt by
the time it was sent, each server's load (requests routed there and not finished) and prefill
tokens in flight (the router's own count of requests there before their first token), the cost
the simulator's ``kv_aware`` rule gives each server from that state
(``arc_simulator.routing.prefix_cost``), the servers of least cost, and whether the router
chose one of them. The router decides a moment after the load test stamps a request sent, and
sees a request's first and last token and an event batch a moment apart from where the load
test and vLLM stamp them: a decision is ``explained`` when the router's choice is one
the rule makes, and its credit what the chosen server had published, at some moment within the
recording's boundary of the stamp (``boundary_s``).

The decisions also give the placement the router made; ``predict_on_placement`` runs the
simulator's fleet on it (``RecordedPlacement``), so a run's hit rate can be compared with the
model of the servers' caches apart from the model of the router.

Block identity: a prompt's blocks are found in a server's ``BlockStored`` events by their
tokens, walking from the first block, each after its parent, so no hash is recomputed here.
vllm-router 0.1.17 skips a ``BlockStored`` whose parent hash it never saw stored ("unknown
parent; skipping unanchored store", ``src/kv_index/indexer.rs``); ``unanchored_stores``
counts those in a recording that starts with empty caches.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from arc_harness.kv_events import KvBatch
from arc_serving_common.traces import TraceRequest
from arc_simulator.fleet import simulate_routed
from arc_simulator.routing import FleetView, credited_blocks, prefix_cost
from arc_simulator.simulate import CostModel, SimulationResult

DECISION = "KV prefix decision"
CACHE_DECISION = "Cache prefix decision"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')
# How far apart the router's view and the records may stamp one change, at least: on a shared
# two-core machine a request's end reached the router up to 55 ms after the load test saw it.
BOUNDARY_S = 0.060
# The share of a recording's batches whose delivery lag the boundary covers (``boundary_s``).
LAG_QUANTILE = 0.9
# How far apart the router's log and the load test may order two requests sent together.
REORDER_WINDOW = 4


class DecisionRecordError(ValueError):
    """The records of one replay do not join; the message says where."""


@dataclass(frozen=True, slots=True)
class RouterDecision:
    """One ``KV prefix decision`` line of the router's debug log."""

    outcome: str
    worker: str
    input_tokens: int
    new_prefill_tokens: int
    credited_prefix_tokens: int


def logged_fields(log: str, message: str) -> list[dict[str, str]]:
    """The fields of each line of the router's log that carries ``message``, in log order
    (tracing prints ``message key=value ...``, colours stripped, quotes removed)."""
    return [
        {
            key: value.strip('"')
            for key, value in _FIELD.findall(_ANSI.sub("", line).split(message, 1)[1])
        }
        for line in log.splitlines()
        if message in line
    ]


def answered_in_sending_order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answered requests of a replay's ``results.jsonl`` rows, in the order they were
    sent: the order the router logged its decisions in."""
    return sorted((row for row in rows if row["ok"]), key=lambda row: row["sent_wall"])


def server_of(url: str, worker_urls: Sequence[str]) -> int:
    """The server index of the worker ``url`` the router chose (``worker_urls`` in server
    order); DecisionRecordError if it is none of them."""
    try:
        return list(worker_urls).index(url)
    except ValueError:
        raise DecisionRecordError(f"the router chose {url!r}, not a server") from None


def router_decisions(log: str) -> list[RouterDecision]:
    """The router's scored decisions (outcome ``prefix_cost``), in log order."""
    found = []
    for fields in logged_fields(log, DECISION):
        if fields.get("outcome") != "prefix_cost":
            continue  # a request without tokens (the load test's start-up probes)
        found.append(
            RouterDecision(
                fields["outcome"],
                fields["worker"],
                int(fields["input_tokens"]),
                int(fields["new_prefill_tokens"]),
                int(fields["credited_prefix_tokens"]),
            )
        )
    return found


@dataclass(frozen=True, slots=True)
class State:
    """What a router could know of each server at one moment, in server order: the prompt
    tokens it had published as cached (capped as the router credits them), its load
    (requests routed there and not finished) and its prefill tokens in flight (the router's
    count of the requests routed there before their first token)."""

    published_tokens: list[int]
    loads: list[int]
    in_flight_prefill: list[int]


Cost = Callable[[int, int, int], int]  # (new tokens, in-flight prefill tokens, load) -> cost


def least_cost(state: State, input_tokens: int, cost: Cost = prefix_cost) -> list[int]:
    """The servers the ``kv_aware`` rule picks from ``state``: those of least ``cost``."""
    costs = [
        cost(input_tokens - published, in_flight, load)
        for published, in_flight, load in zip(
            state.published_tokens, state.in_flight_prefill, state.loads, strict=True
        )
    ]
    return [server for server, value in enumerate(costs) if value == min(costs)]


@dataclass(frozen=True, slots=True)
class Decision:
    """One request's decision and the state it was made from (see the module docstring).

    ``state`` is at the load test's stamp, ``window`` every distinct state within the
    recording's ``boundary_s`` of it (``state`` among them). ``served_cached_tokens`` is vLLM's
    count of the request's cached prompt tokens on the server that served it (None when not
    reported).
    """

    index: int
    sent_s: float
    input_tokens: int
    worker: int
    router_new_tokens: int
    router_credited_tokens: int
    state: State
    window: list[State]
    served_cached_tokens: int | None

    def rule(self, cost: Cost = prefix_cost) -> list[int]:
        """The servers of least cost at the stamp (more than one: a tie)."""
        return least_cost(self.state, self.input_tokens, cost)

    def agrees(self, cost: Cost = prefix_cost) -> bool:
        return self.worker in self.rule(cost)

    @property
    def credit_matches(self) -> bool:
        """The router credited its worker with what that server had published."""
        return self.router_credited_tokens == self.state.published_tokens[self.worker]

    def explained(self, cost: Cost = prefix_cost) -> bool:
        """Some state of the window has the router's choice among the least cost and its
        credit as published."""
        return any(
            self.worker in least_cost(state, self.input_tokens, cost)
            and state.published_tokens[self.worker] == self.router_credited_tokens
            for state in self.window
        )


class _Published:
    """What each server published, readable at any moment.

    ``names[s]`` maps (parent hash, block tokens) to server ``s``'s hash for that block, from
    its ``BlockStored`` events; ``spans[s]`` maps each hash to the times it was published as
    cached, [stored, removed) pairs (removed: infinity while it stays).
    """

    def __init__(self, servers: int, batches: Sequence[KvBatch], block: int) -> None:
        self.block = block
        self.names: list[dict[tuple[str | None, tuple[int, ...]], str]] = [
            {} for _ in range(servers)
        ]
        self.spans: list[dict[str, list[list[float]]]] = [{} for _ in range(servers)]
        self.changes: list[float] = []  # every batch's publication, in order
        for batch in sorted(batches, key=lambda batch: batch.published):
            self.changes.append(batch.published)
            names, spans = self.names[batch.server], self.spans[batch.server]
            for event in batch.events:
                if event.kind == "BlockStored":
                    parent = event.parent
                    for position, name in enumerate(event.block_hashes):
                        tokens = event.token_ids[position * block : (position + 1) * block]
                        names[(parent, tuple(tokens))] = name
                        parent = name
                        held = spans.setdefault(name, [])
                        if not held or held[-1][1] != math.inf:
                            held.append([batch.published, math.inf])
                else:
                    removed = event.block_hashes if event.kind == "BlockRemoved" else list(spans)
                    for name in removed:
                        held = spans.get(name)
                        if held and held[-1][1] == math.inf:
                            held[-1][1] = batch.published

    def changes_within(self, low: float, high: float) -> list[float]:
        return self.changes[bisect_right(self.changes, low) : bisect_left(self.changes, high)]

    def cached(self, server: int, name: str, moment: float) -> bool:
        return any(start <= moment < end for start, end in self.spans[server].get(name, ()))

    def published_blocks(self, server: int, prompt: Sequence[int], moment: float) -> int:
        """Leading full blocks of ``prompt`` the server had published as cached at
        ``moment``."""
        names, block = self.names[server], self.block
        parent: str | None = None
        for position in range(len(prompt) // block):
            name = names.get((parent, tuple(prompt[position * block : (position + 1) * block])))
            if name is None or not self.cached(server, name, moment):
                return position
            parent = name
        return len(prompt) // block


def _match(
    rows: Sequence[dict[str, Any]], decisions: Sequence[RouterDecision]
) -> list[RouterDecision]:
    """The router's decision for each row (rows in sending order): the first unmatched one
    of the same prompt length among the next few, since two requests sent together may
    reach the router in the other order."""
    left = list(decisions)
    matched = []
    for row in rows:
        window = left[:REORDER_WINDOW]
        position = next(
            (i for i, d in enumerate(window) if d.input_tokens == row["input_tokens"]), None
        )
        if position is None:
            raise DecisionRecordError(
                f"no router decision for request {row['index']} ({row['input_tokens']} "
                f"tokens) among the next {len(window)} logged: "
                f"{[d.input_tokens for d in window]}"
            )
        matched.append(left.pop(position))
    if left:
        raise DecisionRecordError(f"{len(left)} router decisions match no request")
    return matched


def boundary_s(batches: Sequence[KvBatch]) -> float:
    """How far from a request's stamp the router's view may be: ``BOUNDARY_S``, or the time
    within which the recorder received nine batches in ten after vLLM stamped them, whichever
    is longer. The router subscribes to the same publishers on the same machine, so on a loaded
    machine it falls behind as the recorder does (measured: the router credited a prefix 150 ms
    short of what had been stamped published, in a run whose recorder lagged 242 ms at p90)."""
    lags = sorted(batch.received - batch.published for batch in batches)
    if not lags:
        return BOUNDARY_S
    return max(BOUNDARY_S, lags[round(LAG_QUANTILE * (len(lags) - 1))])


def join_decisions(
    requests: Sequence[TraceRequest],
    prompt: Callable[[TraceRequest], list[int]],
    rows: Sequence[dict[str, Any]],
    router_log: str,
    batches: Sequence[KvBatch],
    worker_urls: Sequence[str],
    block: int,
) -> list[Decision]:
    """One ``Decision`` per answered request, in sending order (see the module docstring).

    ``rows`` are the replay's ``results.jsonl`` rows, ``worker_urls`` the servers' URLs in
    server order (the router logs the URL it chose). Raises ``DecisionRecordError`` when the
    records do not join.
    """
    by_index = {request.index: request for request in requests}
    answered = answered_in_sending_order(rows)
    decisions = _match(answered, router_decisions(router_log))
    servers = len(worker_urls)
    published_state = _Published(servers, batches, block)
    boundary = boundary_s(batches)
    start = answered[0]["sent_wall"] if answered else 0.0
    earlier: list[_Routed] = []
    out = []
    for row, decision in zip(answered, decisions, strict=True):
        worker = server_of(decision.worker, worker_urls)
        now = row["sent_wall"]
        request = by_index[row["index"]]
        tokens = prompt(request)
        state = _state(published_state, now, request, tokens, earlier)
        # Every state the window around the stamp holds: its ends and each change inside it.
        low, high = now - boundary, now + boundary
        moments = [low, now, high, *published_state.changes_within(low, high)]
        moments += [
            moment
            for routed in earlier
            for moment in (routed.first_token, routed.end)
            if low < moment < high
        ]
        window: list[State] = []
        for moment in sorted(moments):
            other = _state(published_state, moment, request, tokens, earlier)
            if other not in window:
                window.append(other)
        out.append(
            Decision(
                index=request.index,
                sent_s=now - start,
                input_tokens=request.input_length,
                worker=worker,
                router_new_tokens=decision.new_prefill_tokens,
                router_credited_tokens=decision.credited_prefix_tokens,
                state=state,
                window=window,
                served_cached_tokens=row.get("cached_tokens"),
            )
        )
        ttft = row["ttft_s"] if row["ttft_s"] is not None else row["e2e_s"]
        earlier.append(
            _Routed(now, now + ttft, now + row["e2e_s"], worker, decision.new_prefill_tokens)
        )
    return out


@dataclass(frozen=True, slots=True)
class _Routed:
    """An earlier request as the router counts it: on ``server`` from ``sent`` to ``end``,
    its ``new`` prefill tokens in flight until its first token."""

    sent: float
    first_token: float
    end: float
    server: int
    new: int


def _state(
    published_state: _Published,
    moment: float,
    request: TraceRequest,
    tokens: Sequence[int],
    earlier: Sequence[_Routed],
) -> State:
    servers, block = len(published_state.names), published_state.block
    loads, in_flight = [0] * servers, [0] * servers
    for routed in earlier:
        if moment < routed.end:
            loads[routed.server] += 1
        if moment < routed.first_token:
            in_flight[routed.server] += routed.new
    published = [
        credited_blocks(
            published_state.published_blocks(s, tokens, moment), request.input_length, block
        )
        * block
        for s in range(servers)
    ]
    return State(published, loads, in_flight)


def unanchored_stores(batches: Sequence[KvBatch]) -> int:
    """``BlockStored`` events whose parent hash no earlier event stored: the router's index
    skips them, so their blocks are never credited."""
    seen: set[str] = set()
    skipped = 0
    for batch in sorted(batches, key=lambda batch: batch.published):
        for event in batch.events:
            if event.kind != "BlockStored":
                continue
            if event.parent is not None and event.parent not in seen:
                skipped += 1
            seen.update(event.block_hashes)
    return skipped


def service_times(new_tokens: Mapping[int, int], rows: Sequence[dict[str, Any]]) -> CostModel:
    """The simulator's cost model as one replay served: time to first token against each
    request's new prefill tokens (request index to tokens; a least-squares line: the step and
    the time per token), and the mean time between output tokens."""
    ttft = {row["index"]: row["ttft_s"] for row in rows if row["ok"]}
    pairs = [(new, ttft[index]) for index, new in new_tokens.items() if ttft.get(index)]
    if len({new for new, _ in pairs}) < 2:
        raise DecisionRecordError("too few distinct prefill sizes to fit the service times")
    slope, intercept = statistics.linear_regression(*zip(*pairs, strict=True))
    gaps = [gap for row in rows if row["ok"] for gap in row.get("itl_s") or ()]
    return CostModel(
        prefill_seconds_per_token=max(slope, 1e-7),
        decode_seconds_per_token=statistics.fmean(gaps) if gaps else 0.0,
        step_seconds=max(intercept, 0.0),
    )


class RecordedPlacement:
    """A simulator router that sends each request where the real router sent it.

    With it the model predicts a run's hit rate from the run's own placement, so what is left
    between the two is the model of the servers' caches, not of the router's choices.
    """

    name = "recorded"

    def __init__(self, placement: Mapping[int, int]) -> None:
        self._workers = placement

    def route(self, request: TraceRequest, view: FleetView) -> int:
        try:
            return self._workers[request.index]
        except KeyError:
            raise DecisionRecordError(f"request {request.index} has no recorded decision") from None


def predict_on_placement(
    requests: Sequence[TraceRequest],
    placement: Mapping[int, int],
    policy: str,
    capacity: int,
    servers: int,
    cost: CostModel,
) -> SimulationResult:
    """The simulator's fleet (overlapping mode) on the placement the router recorded
    (request index to server)."""
    result, _ = simulate_routed(
        requests, policy, capacity, servers, RecordedPlacement(placement), sequential=False,
        cost=cost,
    )  # fmt: skip
    return result


def cache_aware_placement(
    rows: Sequence[dict[str, Any]], router_log: str, worker_urls: Sequence[str]
) -> dict[int, int]:
    """Where the ``cache_aware`` router sent each answered request: its debug log's ``Cache
    prefix decision`` lines (the selected worker), in sending order. The lines carry no
    prompt to match them by, so two requests sent within moments of each other may be paired
    the wrong way round; the placement's shares are exact either way."""
    selected = [fields.get("selected", "") for fields in logged_fields(router_log, CACHE_DECISION)]
    answered = answered_in_sending_order(rows)
    if len(selected) != len(answered):
        raise DecisionRecordError(
            f"the router logged {len(selected)} cache_aware decisions for "
            f"{len(answered)} answered requests"
        )
    return {
        row["index"]: server_of(url, worker_urls)
        for row, url in zip(answered, selected, strict=True)
    }


def summarise(decisions: Sequence[Decision]) -> dict[str, Any]:
    """What the decisions of one replay add up to.

    ``sent_away``: decisions whose chosen server had published less of the prompt than
    another server (the load term outweighed the cached prefix), and ``tokens_given_up`` the
    prefix tokens those left behind.
    """

    def given_up(decision: Decision) -> int:
        published = decision.state.published_tokens
        return max(published) - published[decision.worker]

    return {
        "decisions": len(decisions),
        "credit_matches": sum(d.credit_matches for d in decisions),
        "rule_agrees": sum(d.agrees() for d in decisions),
        "ties": sum(len(d.rule()) > 1 for d in decisions),
        "explained": sum(d.explained() for d in decisions),
        "sent_away": sum(given_up(d) > 0 for d in decisions),
        "tokens_given_up": sum(given_up(d) for d in decisions),
        "credited_tokens": sum(d.state.published_tokens[d.worker] for d in decisions),
        "input_tokens": sum(d.input_tokens for d in decisions),
        "mean_load": statistics.fmean(sum(d.state.loads) for d in decisions) if decisions else 0.0,
    }


def describe(summary: dict[str, Any]) -> str:
    """One line for the demo's progress output (``boundary_s``: the recording's)."""
    return (
        f"{summary['rule_agrees']}/{summary['decisions']} decisions the model's rule makes from "
        f"the state recorded at its stamp ({summary['ties']} ties), {summary['explained']} "
        f"within {summary['boundary_s'] * 1000:.0f} ms of it; credit as published "
        f"{summary['credit_matches']}/{summary['decisions']}; "
        f"{summary['sent_away']} sent away from a holder; mean load at a decision "
        f"{summary['mean_load']:.2f}"
    )


def write_decisions(path: Path, decisions: Sequence[Decision]) -> None:
    with path.open("w") as out:
        for decision in decisions:
            row = asdict(decision) | {"rule": decision.rule(), "explained": decision.explained()}
            out.write(json.dumps(row) + "\n")


def read_decisions(path: Path) -> list[Decision]:
    """``write_decisions``'s rows back (the rule's columns are recomputed, not read)."""
    decisions = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        del row["rule"], row["explained"]
        row["state"] = State(**row["state"])
        row["window"] = [State(**state) for state in row["window"]]
        decisions.append(Decision(**row))
    return decisions
