"""Per-request rows to a run summary, and the server's prefix-cache counters.

The summary's hit rate is the server's own: the change of vLLM's
``vllm:prefix_cache_hits_total`` over the change of ``vllm:prefix_cache_queries_total``
(both in tokens) between a scrape before the first request and one after the last answer.
Series with several label sets (engines, models) are summed. Behind a load balancer with
several replicas, one scrape sees one replica only: point ``--host`` at a single server, or
read the hit rate from Prometheus instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PERCENTILES = (50, 90, 99)
# Where the hit rate is when the host's /metrics is not one engine's (an ingress, the router,
# several replicas): the chart's dashboard, the custom resource's status, or Prometheus.
WHERE_TO_READ_HIT_RATE = (
    'read it on the dashboard "arc-serving / Prefix cache and latency" (panel "Prefix-cache '
    "hit rate per policy\"), in the ServingPolicy's status (kubectl get servingpolicy NAME "
    "-o jsonpath='{.status.hitRate}'), or from Prometheus: "
    f"sum(increase({HITS}[RUN])) / sum(increase({QUERIES}[RUN])) over the run's duration"
)
# How a failed request failed (the locustfile's failure_kind): in flight (sent, then the
# connection broke or the stream was cut), refused (never reached the server), a proxy's
# gateway error, or another HTTP error answer.
FAILURE_KINDS = ("in_flight", "refused", "gateway", "error")


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """One scrape of the server's prefix-cache counters (tokens)."""

    hits: float
    queries: float


def parse_counters(text: str) -> CacheCounters:
    """Sum the prefix-cache counters over all label sets of a Prometheus text page."""
    totals = {HITS: 0.0, QUERIES: 0.0}
    seen = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            # name{labels} value [timestamp]; label values may hold spaces, so cut after '}'
            rest = line.rsplit("}", 1)[1] if "{" in line else line[len(name) :]
            totals[name] += float(rest.split()[0])
            seen.add(name)
    missing = set(totals) - seen
    if missing:
        raise ValueError(
            f"its /metrics has no {', '.join(sorted(missing))}: not a vLLM engine's metrics"
        )
    return CacheCounters(hits=totals[HITS], queries=totals[QUERIES])


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation) and mean; None for no values."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None, "count": 0}
    array = np.asarray(values, dtype=float)
    result: dict[str, float | None] = {f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}
    return result | {"mean": float(array.mean()), "count": len(values)}


def summarize(
    rows: Iterable[dict[str, Any]],
    *,
    planned: int,
    start: CacheCounters | None,
    end: CacheCounters | None,
    duration_s: float,
    setup_error: str | None = None,
    stop_reason: str | None = None,
    counters_error: str | None = None,
) -> dict[str, Any]:
    """The run's summary from its per-request rows.

    ``planned`` is the number of requests in the trace; the difference to the rows
    (``requests_unsent``) is the requests without an answer read: cut off by the run time,
    never sent after an early stop, or abandoned in flight by it. Throughput counts answered
    requests over ``duration_s``.
    ``requests_unauthorized`` counts the HTTP 401 answers (no API key or a wrong one);
    ``setup_error`` is why the replay could not start (None when it started);
    ``stopped_early`` is why it stopped before the end of the trace (the server became
    unreachable), None when it did not. ``failures`` counts the failed requests by kind
    (``FAILURE_KINDS``); ``requests_failed_in_flight`` is its ``in_flight`` count: requests
    the server had accepted (or whose connection broke after sending) when they failed.
    ``prefix_cache.unread`` is why the server's counters could not be read (``counters_error``;
    behind an ingress or a router ``/metrics`` is not the engines').
    """
    rows = list(rows)
    ok = [r for r in rows if r["ok"]]
    itl = [gap for r in ok for gap in r["itl_s"]]
    summary: dict[str, Any] = {
        "requests_planned": planned,
        "requests_sent": len(rows),
        "requests_ok": len(ok),
        "requests_failed": len(rows) - len(ok),
        "requests_unsent": planned - len(rows),
        "requests_failed_in_flight": sum(1 for r in rows if r.get("failure") == "in_flight"),
        "failures": {
            kind: sum(1 for r in rows if not r["ok"] and r.get("failure") == kind)
            for kind in FAILURE_KINDS
        },
        "requests_unauthorized": sum(1 for r in rows if r.get("status") == 401),
        "setup_error": setup_error,
        "stopped_early": stop_reason,
        "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens": sum(r["output_tokens"] for r in ok),
        "output_tokens_per_s": (
            sum(r["output_tokens"] for r in ok) / duration_s if duration_s > 0 else None
        ),
        "ttft_s": percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "dispatch_lag_s": percentiles([r["lag_s"] for r in rows]),
        "session_hold_s": percentiles([r["held_s"] for r in rows]),
    }
    cache: dict[str, Any] = {"hit_rate": None, "unread": counters_error}
    if start is not None and end is not None:
        hits, queries = end.hits - start.hits, end.queries - start.queries
        cache |= {
            "hits_start": start.hits,
            "hits_end": end.hits,
            "queries_start": start.queries,
            "queries_end": end.queries,
            "hit_tokens": hits,
            "query_tokens": queries,
            "hit_rate": hits / queries if queries > 0 else None,
        }
    summary["prefix_cache"] = cache
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.1f}"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a small text table (times in milliseconds)."""
    lines = []
    if summary.get("setup_error"):
        lines.append(f"replay did not start: {summary['setup_error']}")
    if summary.get("stopped_early"):
        lines.append(f"replay stopped early: {summary['stopped_early']}")
    if summary.get("requests_unauthorized"):
        lines.append(
            f"authentication failed: {summary['requests_unauthorized']} requests answered "
            "HTTP 401 (no API key or a wrong one)"
        )
    lines += [
        f"requests: {summary['requests_ok']} ok, {summary['requests_failed']} failed, "
        f"{summary['requests_unsent']} unsent"
        + (" or abandoned in flight" if summary.get("stopped_early") else "")
        + f" of {summary['requests_planned']} "
        f"in {summary['duration_s']:.1f} s",
    ]
    if summary["requests_failed"]:
        counts = summary["failures"].items()
        kinds = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in counts if count)
        lines.append(f"failed requests: {kinds or 'kind not recorded'}")
    if summary["throughput_rps"] is not None:
        lines.append(
            f"throughput: {summary['throughput_rps']:.2f} req/s, "
            f"{summary['output_tokens_per_s']:.1f} output tokens/s"
        )
    lines.append(f"{'ms':<16}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'count':>8}")
    for key, label in (
        ("ttft_s", "TTFT"),
        ("itl_s", "ITL"),
        ("e2e_s", "end-to-end"),
        ("dispatch_lag_s", "dispatch lag"),
        ("session_hold_s", "session hold"),
    ):
        stats = summary[key]
        lines.append(
            f"{label:<16}{_ms(stats['p50']):>10}{_ms(stats['p90']):>10}"
            f"{_ms(stats['p99']):>10}{_ms(stats['mean']):>10}{stats['count']:>8}"
        )
    cache = summary["prefix_cache"]
    if cache.get("unread"):
        lines.append(f"prefix-cache hit rate: not read here: {cache['unread']}")
        lines.append(f"  {WHERE_TO_READ_HIT_RATE}")
    elif cache["hit_rate"] is None:
        lines.append("prefix-cache hit rate: - (no prompt tokens queried)")
    else:
        lines.append(
            f"prefix-cache hit rate: {cache['hit_rate']:.4f} "
            f"({cache['hit_tokens']:.0f} of {cache['query_tokens']:.0f} prompt tokens)"
        )
    return "\n".join(lines)


def write_rows(path: str, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
