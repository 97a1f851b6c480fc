"""Replay settings and the run's results, independent of Locust.

``ReplaySettings`` is what the command line (or ``run_replay``) fixes; ``Results`` collects
per-request rows from the local dispatcher or from workers' messages and turns them into the
JSONL file and the summary. Nothing here imports Locust, so it is safe to use from the demo
and from tests without gevent's monkey patching.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from arc_loadtest.report import CacheCounters, format_summary, parse_counters, summarize, write_rows
from arc_loadtest.schedule import PlannedRequest, plan_replay
from arc_loadtest.tokens import (
    Vocabulary,
    VocabularyError,
    vocabulary_from_server,
    vocabulary_from_tokenizer,
)
from arc_serving_common.traces import TraceRequest, load_trace

log = logging.getLogger("loadtest")

# The API key's variable (also --api-key). No fallback to OPENAI_API_KEY: a key meant for
# another service must never be sent to the server under test by accident.
LOADTEST_API_KEY_ENV = "LOADTEST_API_KEY"
# The log line that carries the run's summary as JSON, after the text table.
SUMMARY_LOG_PREFIX = "replay summary json "


class AuthenticationError(RuntimeError):
    """The server answered HTTP 401: the API key is missing or wrong (the key is not shown)."""


def auth_failure(has_key: bool) -> str:
    """Why a 401 happened, and what to do; never includes the key."""
    if has_key:
        return "authentication failed: the server rejected the API key (HTTP 401)"
    return (
        "authentication failed: the server requires an API key (HTTP 401); "
        f"set {LOADTEST_API_KEY_ENV} or pass --api-key"
    )


def auth_headers(api_key: str) -> dict[str, str]:
    """The headers that carry ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """The options of one replay (see the locustfile's command line for their meaning)."""

    host: str
    trace: str
    trace_format: str = "auto"
    block_tokens: int = 0  # 0: the trace form's own (Mooncake 512, Bailian 16)
    time_scale: float = 1.0
    seed: int = 0
    results: str = ""
    summary: str = ""
    model: str = ""
    tokenizer: str = ""
    request_timeout_s: float = 600.0
    # Stop the replay after this many consecutive requests got no HTTP answer (0: never).
    max_unreachable: int = 10
    # Sent as "Authorization: Bearer KEY"; kept out of repr so no log line can show it.
    api_key: str = field(default="", repr=False)

    @classmethod
    def from_options(cls, options: Any, host: str) -> ReplaySettings:
        return cls(
            host=host.rstrip("/"),
            trace=options.trace,
            trace_format=options.trace_format,
            block_tokens=options.block_tokens,
            time_scale=options.time_scale,
            seed=options.seed,
            results=options.results,
            summary=options.summary,
            model=options.model,
            tokenizer=options.tokenizer,
            request_timeout_s=options.request_timeout,
            max_unreachable=options.max_unreachable,
            api_key=getattr(options, "api_key", "") or "",
        )

    def validate(self) -> None:
        """Raise ValueError naming the first bad option; reads nothing."""
        if not self.host.startswith(("http://", "https://")):
            raise ValueError(f"--host must be an http(s) URL, got {self.host!r}")
        if not self.trace:
            raise ValueError("--trace (or LOADTEST_TRACE) is required")
        if self.block_tokens < 0:
            raise ValueError(
                f"--block-tokens must be >= 1 (0: the form's), got {self.block_tokens}"
            )
        # Finite too: an infinite scale puts every request after the end of time (a hang).
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--time-scale must be a finite number > 0, got {self.time_scale}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise ValueError(
                f"--request-timeout must be a finite number > 0, got {self.request_timeout_s}"
            )
        if self.max_unreachable < 0:
            raise ValueError(
                f"--max-unreachable must be >= 0 (0: never stop), got {self.max_unreachable}"
            )
        if any(char.isspace() or not char.isprintable() for char in self.api_key):
            # The message must not echo the key.
            raise ValueError(
                f"--api-key (or {LOADTEST_API_KEY_ENV}) must not contain spaces, line breaks or "
                "control characters"
            )

    def load_plan(self) -> list[PlannedRequest]:
        """Read and plan the whole trace; a bad line raises TraceError before anything runs."""
        trace: list[TraceRequest] = load_trace(
            self.trace, self.trace_format, block_tokens=self.block_tokens or None
        )
        return plan_replay(trace, self.time_scale, path=self.trace)


class ServerClient:
    """Small blocking JSON client for the server's non-benchmarked endpoints.

    Every request carries the API key (when there is one); a 401 raises AuthenticationError.
    """

    def __init__(self, host: str, timeout_s: float = 30.0, api_key: str = "") -> None:
        self.host = host.rstrip("/")
        self.timeout_s = timeout_s
        self._has_key = bool(api_key)
        self._session = requests.Session()
        self._session.headers.update(auth_headers(api_key))

    def _checked(self, response: requests.Response, path: str) -> tuple[int, Any]:
        if response.status_code == 401:
            raise AuthenticationError(f"{auth_failure(self._has_key)} on {self.host}{path}")
        return response.status_code, _json_or_text(response)

    def get_json(self, path: str) -> tuple[int, Any]:
        response = self._session.get(self.host + path, timeout=self.timeout_s)
        return self._checked(response, path)

    def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        response = self._session.post(self.host + path, json=body, timeout=self.timeout_s)
        return self._checked(response, path)

    def served_model(self) -> str:
        """The first model ``/v1/models`` lists."""
        status, data = self.get_json("/v1/models")
        if status != 200 or not isinstance(data, dict) or not data.get("data"):
            raise VocabularyError(f"{self.host}/v1/models answered HTTP {status}: {data!r:.200}")
        return str(data["data"][0]["id"])

    def counters(self) -> CacheCounters:
        response = self._session.get(self.host + "/metrics", timeout=self.timeout_s)
        response.raise_for_status()
        return parse_counters(response.text)

    def settled_counters(self, timeout_s: float = 5.0, interval_s: float = 0.25) -> CacheCounters:
        """Counters once two scrapes agree: the server updates them just after answering."""
        previous = self.counters()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(interval_s)
            current = self.counters()
            if current == previous:
                return current
            previous = current
        return previous

    def close(self) -> None:
        self._session.close()


def _json_or_text(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def load_vocabulary(settings: ReplaySettings, client: ServerClient, model: str) -> Vocabulary:
    if settings.tokenizer:
        return vocabulary_from_tokenizer(settings.tokenizer)
    return vocabulary_from_server(client, model)


class Results:
    """Rows of one run and the summary made from them.

    Invariant: at most one row per trace request index (a duplicate is a bug upstream).
    """

    def __init__(self, settings: ReplaySettings, planned: int) -> None:
        self.settings = settings
        self.planned = planned
        self.rows: dict[int, dict[str, Any]] = {}
        self.start_counters: CacheCounters | None = None
        self.counters_error: str | None = None  # why the counters could not be read
        self.start_wall = time.time()
        self.setup_error: str | None = None  # why the replay could not start, if it did not
        self.stop_reason: str | None = None  # why the replay stopped early, if it did
        self.summary: dict[str, Any] | None = None

    def add(self, row: dict[str, Any]) -> None:
        if row["index"] in self.rows:
            raise RuntimeError(f"request {row['index']} reported twice")
        self.rows[row["index"]] = row

    def finish(self, end_counters: CacheCounters | None) -> dict[str, Any]:
        """Write the JSONL rows and summary files and return the summary (once)."""
        if self.summary is not None:
            return self.summary
        rows = [self.rows[i] for i in sorted(self.rows)]
        ends = [r["sent_wall"] + r["e2e_s"] for r in rows]
        duration = (max(ends) if ends else time.time()) - self.start_wall
        self.summary = summarize(
            rows,
            planned=self.planned,
            start=self.start_counters,
            end=end_counters,
            duration_s=duration,
            setup_error=self.setup_error,
            stop_reason=self.stop_reason,
            counters_error=self.counters_error,
        )
        if self.settings.results:
            Path(self.settings.results).parent.mkdir(parents=True, exist_ok=True)
            write_rows(self.settings.results, rows)
        if self.settings.summary:
            Path(self.settings.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(self.settings.summary).write_text(json.dumps(self.summary, indent=2) + "\n")
        log.info("replay summary\n%s", format_summary(self.summary))
        # One line a log collector (or `kubectl logs`) reads back whole, where no file is kept.
        log.info("%s%s", SUMMARY_LOG_PREFIX, json.dumps(self.summary, sort_keys=True))
        return self.summary
