"""The load test's stop rule for a vanished server: its option and how the summary shows it
(the rule itself runs against a killed real server in test_server_kill)."""

from __future__ import annotations

import pytest

from loadtest.replay import ReplaySettings
from loadtest.report import format_summary, summarize


def test_negative_max_unreachable_is_refused_by_name() -> None:
    settings = ReplaySettings(host="http://127.0.0.1:1", trace="t.jsonl", max_unreachable=-1)
    with pytest.raises(ValueError, match=r"--max-unreachable must be >= 0 .*got -1"):
        settings.validate()


def test_zero_max_unreachable_is_accepted_as_never() -> None:
    ReplaySettings(host="http://127.0.0.1:1", trace="t.jsonl", max_unreachable=0).validate()


def test_summary_says_why_the_replay_stopped_early() -> None:
    reason = "the server did not answer 10 requests in a row (connection refused or lost)"
    summary = summarize([], planned=5, start=None, end=None, duration_s=1.0, stop_reason=reason)
    assert summary["stopped_early"] == reason and summary["requests_unsent"] == 5
    assert f"replay stopped early: {reason}" in format_summary(summary)
    assert summarize([], planned=0, start=None, end=None, duration_s=1.0)["stopped_early"] is None
