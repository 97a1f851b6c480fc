"""``arc-evictor sessions TRACE``: the sessions a trace's requests get, held to the truth.

    arc-evictor sessions TRACE [--format auto] [--block-tokens N] [--json]

Prints how many session keys ``arc_serving_common.sessions`` gives the trace's requests (the
``X-Session-ID`` the load test sends and the simulator's session-keyed routers read) and the
largest key's share, which a session-keyed router puts on one replica. Where the trace's
records carry their true session (``true_session``, written by ``arc-evictor generate`` in
the Mooncake form and read by nothing else), it also compares the keys with the truth:

- pairs of requests put together that are in different conversations, and pairs kept
  apart that are in one;
- exception requests: a request is one when its key is not the one holding most of its
  conversation's requests, or its conversation is not the one holding most of its key's
  requests; relabelling the exceptions alone would make the keys equal to the truth, give
  or take ties;
- explained pairs: the wrong pairs with a request whose full blocks end where another
  conversation's requests also pass or end (or that has no full block), which nothing in
  the hash ids can tell apart (``arc_serving_common.sessions``, "What the blocks cannot
  tell"). A wrong pair that is not explained is a fault of the rule.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from arc_serving_common.jsonutil import loads_unique
from arc_serving_common.sessions import session_keys
from arc_serving_common.traces import FORMATS, TraceError, TraceRequest, load_trace
from arc_simulator.command import Subcommands

TRUE_SESSION_FIELD = "true_session"


@dataclass(frozen=True, slots=True)
class SessionReport:
    """The keys of one trace and, where it carries the truth, how they agree with it."""

    requests: int
    keys: int
    largest_key: str
    largest_key_requests: int
    true_sessions: int | None = None
    wrongly_together: int | None = None  # pairs of requests
    wrongly_apart: int | None = None
    unexplained_pairs: int | None = None
    exception_requests: int | None = None

    @property
    def largest_share(self) -> float:
        return self.largest_key_requests / self.requests

    @property
    def exception_share(self) -> float | None:
        if self.exception_requests is None:
            return None
        return self.exception_requests / self.requests

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "largest_share": self.largest_share,
            "exception_share": self.exception_share,
        }


def true_sessions(path: str | Path, requests: Sequence[TraceRequest]) -> list[int] | None:
    """The ``true_session`` of each request, read from its line; None when the first request's
    record has none. A later record without one, or with a non-integer, raises TraceError."""
    lines = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n")
    truth = []
    for request in requests:
        record = loads_unique(lines[request.line - 1].decode("utf-8"))
        value = record.get(TRUE_SESSION_FIELD)
        if value is None and not truth:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            problem = f"field {TRUE_SESSION_FIELD!r} must be an integer, got {value!r}"
            raise TraceError(path, request.line, problem)
        truth.append(value)
    return truth


def _pairs(counts: Counter[Any]) -> int:
    return sum(math.comb(count, 2) for count in counts.values())


def _dominant(cells: Counter[tuple[Hashable, Hashable]], side: int) -> dict[Hashable, Hashable]:
    """For each value on ``side`` of the cells, the other side's value with most requests
    (the first met on a tie)."""
    best: dict[Hashable, tuple[int, Hashable]] = {}
    for cell, count in cells.items():
        own, other = cell[side], cell[1 - side]
        if own not in best or count > best[own][0]:
            best[own] = (count, other)
    return {own: other for own, (_, other) in best.items()}


def shared_ends(requests: Sequence[TraceRequest], truth: Sequence[int]) -> list[bool]:
    """For each request, whether its last full block is reached by requests of more than one
    true conversation (or it has no full block): the requests no rule can place for sure."""
    reached: dict[int, int] = {}  # block key -> its one conversation, or -1 for several
    for request, session in zip(requests, truth, strict=True):
        for key in request.keys:
            if reached.setdefault(key, session) != session:
                reached[key] = -1
    return [not request.keys or reached[request.keys[-1]] == -1 for request in requests]


def _wrong_pairs(cells: Counter[tuple[str, int]]) -> tuple[int, int]:
    """Pairs of requests that ``cells`` (requests per (key, true session)) put together under
    one key but in two conversations, and apart under two keys but in one conversation."""
    keys: Counter[str] = Counter()
    sessions: Counter[int] = Counter()
    for (key, session), count in cells.items():
        keys[key] += count
        sessions[session] += count
    both = _pairs(cells)
    return _pairs(keys) - both, _pairs(sessions) - both


def compare(
    requests: Sequence[TraceRequest], keys: Sequence[str], truth: Sequence[int] | None
) -> SessionReport:
    """The report for ``keys`` (one per request) against ``truth`` (or without it)."""
    largest, largest_count = Counter(keys).most_common(1)[0]
    report = SessionReport(len(keys), len(set(keys)), largest, largest_count)
    if truth is None:
        return report
    cells = Counter(zip(keys, truth, strict=True))
    wrongly_together, wrongly_apart = _wrong_pairs(cells)
    key_of_session = _dominant(cells, 1)
    session_of_key = _dominant(cells, 0)
    exceptions = sum(
        1
        for key, session in zip(keys, truth, strict=True)
        if key_of_session[session] != key or session_of_key[key] != session
    )
    # The wrong pairs left among the requests whose prompts no other conversation shares.
    shared = shared_ends(requests, truth)
    clean = Counter(
        (key, session)
        for key, session, ambiguous in zip(keys, truth, shared, strict=True)
        if not ambiguous
    )
    return replace(
        report,
        true_sessions=len(set(truth)),
        wrongly_together=wrongly_together,
        wrongly_apart=wrongly_apart,
        unexplained_pairs=sum(_wrong_pairs(clean)),
        exception_requests=exceptions,
    )


def check_trace(
    path: str | Path, fmt: str = "auto", block_tokens: int | None = None
) -> SessionReport:
    """Read the trace at ``path`` and report its session keys (against its truth if any)."""
    requests = load_trace(path, fmt, block_tokens=block_tokens)
    return compare(requests, session_keys(requests), true_sessions(path, requests))


def text(report: SessionReport, trace: str) -> str:
    lines = [
        f"{trace}: {report.requests:,} requests, {report.keys:,} session keys; the largest, "
        f"{report.largest_key}, holds {report.largest_key_requests:,} "
        f"({report.largest_share:.1%})"
    ]
    if report.true_sessions is not None:
        lines.append(
            f"truth: {report.true_sessions:,} conversations; pairs wrongly together "
            f"{report.wrongly_together:,}, wrongly apart {report.wrongly_apart:,} "
            f"({report.unexplained_pairs:,} not explained by a shared prompt); exception "
            f"requests {report.exception_requests:,} ({report.exception_share:.2%})"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    report = check_trace(args.trace, args.format, args.block_tokens)
    print(json.dumps(report.as_dict()) if args.json else text(report, str(args.trace)))
    return 0


def add_sessions_command(commands: Subcommands) -> None:
    sessions = commands.add_parser(
        "sessions", help="the session keys of a trace's requests (X-Session-ID), against its truth"
    )
    sessions.add_argument("trace", help="trace file (Mooncake or Qwen-Bailian JSON lines)")
    sessions.add_argument("--format", default="auto", choices=["auto", *FORMATS])
    sessions.add_argument("--block-tokens", type=int, help="tokens per hash id (default by form)")
    sessions.add_argument("--json", action="store_true", help="print one JSON object")
    sessions.set_defaults(run=_run)
