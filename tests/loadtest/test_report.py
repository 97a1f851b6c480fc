"""Stream timing, counter scraping and the summary's arithmetic."""

from __future__ import annotations

import json

import pytest

from arc_loadtest.report import (
    FAILURE_KINDS,
    CacheCounters,
    format_summary,
    parse_counters,
    summarize,
)
from arc_loadtest.stream import StreamError, StreamStats


def sse(chunk: dict) -> str:
    return "data: " + json.dumps(chunk)


def test_ttft_is_the_first_chunk_with_a_token_not_the_first_chunk() -> None:
    stats = StreamStats(sent=10.0)
    stats.feed_line(sse({"choices": [{"text": "", "token_ids": []}]}), 10.1)
    stats.feed_line(sse({"choices": [{"text": "a", "token_ids": [5]}]}), 10.5)
    stats.feed_line(sse({"choices": [{"text": "bc", "token_ids": [6, 7]}]}), 10.9)
    assert not stats.feed_line("data: [DONE]", 11.0)
    assert stats.ttft == pytest.approx(0.5)
    assert stats.tokens == 3 and stats.itl == pytest.approx([0.2, 0.2])


def test_usage_count_wins_over_counted_chunks() -> None:
    stats = StreamStats(sent=0.0)
    stats.feed_line(sse({"choices": [{"text": "x"}]}), 1.0)
    stats.feed_line(sse({"choices": [], "usage": {"completion_tokens": 4}}), 1.1)
    assert (stats.tokens, stats.output_tokens) == (1, 4)


def test_running_usage_counts_tokens_that_decode_to_no_text() -> None:
    # vLLM's continuous_usage_stats: every chunk carries the completion tokens so far.
    stats = StreamStats(sent=0.0)
    stats.feed_line(sse({"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}), 0.5)
    stats.feed_line(sse({"choices": [{"text": ""}], "usage": {"completion_tokens": 1}}), 1.0)
    stats.feed_line(sse({"choices": [{"text": "ab"}], "usage": {"completion_tokens": 3}}), 1.4)
    assert stats.ttft == pytest.approx(1.0)
    assert stats.tokens == 3 and stats.itl == pytest.approx([0.2, 0.2])


def test_error_chunk_fails_the_stream() -> None:
    with pytest.raises(StreamError, match="server error in stream"):
        StreamStats(sent=0.0).feed_line(sse({"error": {"message": "boom"}}), 1.0)


METRICS = """# HELP vllm:prefix_cache_hits_total hits
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 2.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total_created{engine="0"} 1.7e9
"""


def test_counters_sum_every_label_set() -> None:
    assert parse_counters(METRICS) == CacheCounters(hits=32.0, queries=100.0)


def test_missing_counter_is_named() -> None:
    with pytest.raises(ValueError, match="vllm:prefix_cache_queries_total"):
        parse_counters("vllm:prefix_cache_hits_total 1\n")


def row(index: int, ok: bool = True) -> dict:
    return {"index": index, "ok": ok, "ttft_s": 0.1 * (index + 1), "itl_s": [0.01, 0.03],
            "e2e_s": 0.5, "lag_s": 0.001, "held_s": 0.0, "output_tokens": 3}  # fmt: skip


def test_hit_rate_is_the_change_of_the_server_counters() -> None:
    summary = summarize(
        [row(0), row(1)], planned=2, start=CacheCounters(10, 100), end=CacheCounters(40, 200),
        duration_s=2.0,
    )  # fmt: skip
    assert summary["prefix_cache"]["hit_rate"] == pytest.approx(0.3)
    assert summary["throughput_rps"] == pytest.approx(1.0)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.15)
    assert summary["itl_s"]["count"] == 4


def test_failed_requests_count_but_do_not_enter_latencies() -> None:
    summary = summarize([row(0), row(1, ok=False)], planned=3, start=None, end=None,
                        duration_s=1.0)  # fmt: skip
    assert (summary["requests_failed"], summary["requests_unsent"]) == (1, 1)
    assert summary["ttft_s"]["count"] == 1 and summary["dispatch_lag_s"]["count"] == 2


def test_failed_requests_are_counted_by_kind_and_in_flight_ones_named() -> None:
    kinds = ["in_flight", "in_flight", "refused"]
    failed = [row(n + 1, ok=False) | {"failure": kind} for n, kind in enumerate(kinds)]
    summary = summarize([row(0), *failed], planned=5, start=None, end=None, duration_s=1.0)
    assert summary["requests_failed"] == 3 and summary["requests_failed_in_flight"] == 2
    expected = dict.fromkeys(FAILURE_KINDS, 0) | {"in_flight": 2, "refused": 1}
    assert summary["failures"] == expected
    assert "failed requests: 2 in flight, 1 refused" in format_summary(summary)


def test_a_run_without_failures_names_no_failure_kind() -> None:
    summary = summarize([row(0)], planned=1, start=None, end=None, duration_s=1.0)
    assert summary["requests_failed_in_flight"] == 0
    assert set(summary["failures"].values()) == {0}
    assert "failed requests" not in format_summary(summary)


def test_unread_counters_are_explained_with_where_to_read_the_hit_rate() -> None:
    reason = "404 Client Error: Not Found for url: http://ingress/metrics"
    summary = summarize([row(0)], planned=1, start=None, end=None, duration_s=1.0,
                        counters_error=reason)  # fmt: skip
    assert summary["prefix_cache"] == {"hit_rate": None, "unread": reason}
    lines = format_summary(summary).splitlines()
    assert lines[-2] == f"prefix-cache hit rate: not read here: {reason}"
    assert (
        "status.hitRate" in lines[-1] and "sum(increase(vllm:prefix_cache_hits_total" in (lines[-1])
    )
    read = summarize([row(0)], planned=1, start=CacheCounters(1, 1), end=CacheCounters(1, 1),
                     duration_s=1.0)  # fmt: skip
    assert format_summary(read).endswith("prefix-cache hit rate: - (no prompt tokens queried)")


def test_zero_request_summary_has_no_rates() -> None:
    summary = summarize([], planned=5, start=CacheCounters(1, 1), end=CacheCounters(1, 1),
                        duration_s=0.0)  # fmt: skip
    assert summary["throughput_rps"] is None
    assert summary["prefix_cache"]["hit_rate"] is None
    assert summary["ttft_s"]["p99"] is None and summary["requests_unsent"] == 5
