"""Locust replay of a Mooncake or Qwen-Bailian trace against an OpenAI-compatible server.

    locust -f loadtest/src/arc_loadtest/locustfile.py --headless --host URL --trace PATH \
        [--trace-format auto|mooncake|bailian] [--block-tokens N] [--time-scale F] [--seed N] \
        [--results FILE.jsonl] [--summary FILE.json] [--model NAME] [--tokenizer PATH] \
        --run-time 10m        (API key: env LOADTEST_API_KEY, or --api-key KEY)

Open loop: one dispatcher per load-generating runner sends each trace request at its
(scaled) timestamp from its own greenlet (loadtest.schedule), so Locust's ``--users`` and
``--spawn-rate`` do not change the schedule; ``ReplayUser`` only exists because Locust needs
a User class. Distributed: at test start the master deals the trace's sessions to the
connected workers (``replay_plan`` message), workers stream each finished request's row back
(``replay_row``) and report the end of their share (``replay_done``); the master scrapes the
server's counters, writes the results and summary, and quits. Every worker draws the same
tokens for the same hash id (loadtest.tokens).

Exit codes: 0 when every sent request succeeded; 1 when a request failed, the replay stopped
early (see below) or could not start (server unreachable, bad option, authentication
failed); 2 when the trace is malformed (nothing is sent). Requests without a row (the run
time cut them off, or an early stop abandoned them in flight) are counted as ``unsent`` in the
summary, not as failures.

A server that goes away does not hold the run until the end of the trace: after
``--max-unreachable`` (default 10; 0: never) consecutive requests got no HTTP answer
(connection refused, reset or cut mid-stream) or a gateway's HTTP 502, 503 or 504 (what an
ingress answers for a dead backend), each runner stops sending, abandons what is in flight,
and the run ends with exit code 1; the summary's ``stopped_early`` says why, and the abandoned
requests and the rest of the trace count as ``unsent`` (no row: sent or not, no answer was
read). One request can hang for ``--request-timeout`` at
most, and the whole run for ``--run-time``.

API key: sent as ``Authorization: Bearer KEY`` on every request. Prefer the environment
(``LOADTEST_API_KEY``) to ``--api-key``, which any local user can read in the process list. A
401 fails the run with "authentication failed" in the log and the summary; the key itself is
never logged, written or shown in Locust's web UI. Distributed, every runner reads its own
key: the master blanks it before Locust copies its options to the workers, so it never
crosses the master-worker channel (give each worker ``LOADTEST_API_KEY`` too).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gevent
import requests
from locust import User, constant, events, task
from locust.clients import HttpSession
from locust.env import Environment
from locust.event import EventHook
from locust.runners import LocalRunner, MasterRunner, WorkerRunner
from urllib3 import PoolManager

from arc_loadtest.replay import (
    LOADTEST_API_KEY_ENV,
    AuthenticationError,
    ReplaySettings,
    Results,
    ServerClient,
    auth_failure,
    auth_headers,
    load_vocabulary,
)
from arc_loadtest.schedule import Dispatcher, DispatchTiming, PlannedRequest, partition
from arc_loadtest.stream import StreamError, StreamStats, completion_body
from arc_loadtest.tokens import TokenMapper, Vocabulary, VocabularyError
from arc_serving_common.sessions import crowded_session_warning
from arc_serving_common.traces import FORMATS, TraceError

log = logging.getLogger("loadtest")

COMPLETIONS = "/v1/completions"
# The session id every request carries (schedule.PlannedRequest.session_id), the header the
# vLLM router's consistent_hash policy keys on.
SESSION_HEADER = "X-Session-ID"
START_DELAY_S = 2.0  # workers set up (trace, vocabulary) before the common start
MAX_CONNECTIONS = 512  # open loop: every request in flight holds a connection
# Failures that mean no HTTP answer came (the server is gone), as opposed to a bad answer.
CONNECTION_LOST = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)
# Answers that mean the same behind a proxy or ingress: a dead backend gets a fast 502/503/504
# from it, not a refused connection.
GATEWAY_ERRORS = frozenset({502, 503, 504})


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    group = parser.add_argument_group("trace replay (arc-serving)")
    group.add_argument(
        "--trace", env_var="LOADTEST_TRACE", default="", help="Trace file (JSONL) to replay"
    )
    group.add_argument(
        "--trace-format",
        env_var="LOADTEST_TRACE_FORMAT",
        default="auto",
        choices=["auto", *FORMATS],
        help="Trace form; auto decides by the first line",
    )
    group.add_argument(
        "--block-tokens",
        env_var="LOADTEST_BLOCK_TOKENS",
        type=int,
        default=0,
        help="Tokens per trace hash id (0: the form's, Mooncake 512, Bailian 16)",
    )
    group.add_argument(
        "--time-scale",
        env_var="LOADTEST_TIME_SCALE",
        type=float,
        default=1.0,
        help="Multiply trace timestamps by this (0.5 replays twice as fast)",
    )
    group.add_argument(
        "--seed", env_var="LOADTEST_SEED", type=int, default=0, help="Seed of the token ids"
    )
    group.add_argument(
        "--results", env_var="LOADTEST_RESULTS", default="", help="Per-request rows (JSONL)"
    )
    group.add_argument(
        "--summary", env_var="LOADTEST_SUMMARY", default="", help="Run summary (JSON)"
    )
    group.add_argument(
        "--model", env_var="LOADTEST_MODEL", default="", help="Served model (default: first)"
    )
    group.add_argument(
        "--tokenizer",
        env_var="LOADTEST_TOKENIZER",
        default="",
        help="tokenizer.json (or its folder) for the exact vocabulary; default: ask the server",
    )
    group.add_argument(
        "--request-timeout",
        env_var="LOADTEST_REQUEST_TIMEOUT",
        type=float,
        default=600.0,
        help="Seconds one request may take",
    )
    group.add_argument(
        "--max-unreachable",
        env_var="LOADTEST_MAX_UNREACHABLE",
        type=int,
        default=10,
        help="Stop after this many consecutive requests got no HTTP answer (0: never)",
    )
    api_key = group.add_argument(
        "--api-key",
        env_var=LOADTEST_API_KEY_ENV,
        default="",
        help=f"API key sent as 'Authorization: Bearer KEY' (prefer env {LOADTEST_API_KEY_ENV}: "
        "argv is visible in the process list)",
    )
    # Never in Locust's web UI, which would show the key and post it back from its form. An
    # argument group's options stay out of it already (Locust 2.47 lists only actions carrying
    # this flag set true); the flag keeps the key out if the option ever moves to the parser.
    api_key.include_in_web_ui = False


def failure_kind(status: int | None, problem: BaseException | str) -> str:
    """How a failed request failed (one of report.FAILURE_KINDS).

    ``in_flight``: the request was sent and accepted (HTTP 200) or its connection broke
    (reset, timed out) before the whole answer came; ``refused``: no connection was made, the
    server never saw it; ``gateway``: a proxy's 502/503/504 (its backend failed; whether the
    backend had started the request is unknown); ``error``: any other HTTP error status.
    """
    if status == 200:
        return "in_flight"
    if status in GATEWAY_ERRORS:
        return "gateway"
    if status:
        return "error"
    # No response at all: refused before sending (urllib3's NewConnectionError), or lost.
    text = repr(problem)
    refused = "NewConnectionError" in text or "Connection refused" in text
    return "refused" if refused else "in_flight"


class ReplayUser(User):
    """Idles: the dispatcher sends the trace's requests, so users cannot change the schedule."""

    wait_time = constant(1)

    @task
    def idle(self) -> None:
        """Nothing to do; Locust needs one task per User class."""


@contextmanager
def token_timing(request_event: EventHook, name: str, sent: float) -> Iterator[StreamStats]:
    """Yield a stream's stats; on exit fire its TTFT and mean-ITL rows (milliseconds)."""
    stats = StreamStats(sent=sent)
    try:
        yield stats
    finally:
        for kind, value in (
            ("TTFT", stats.ttft),
            ("ITL", sum(stats.itl) / len(stats.itl) if stats.itl else None),
        ):
            if value is not None:
                request_event.fire(
                    request_type=kind,
                    name=name,
                    response_time=value * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                )


class Replay:
    """One runner's part of the replay: plan, dispatcher, HTTP and result rows.

    Invariants: the master (or the local runner) reads the vocabulary and model once and
    hands them to every worker, so all workers draw tokens from the same ids; only runners
    that generate load (local, worker) own a Dispatcher; only the master and the local
    runner own the Results.
    """

    def __init__(self, environment: Environment) -> None:
        self.environment = environment
        self.settings = ReplaySettings.from_options(
            environment.parsed_options, environment.host or ""
        )
        self.plan: list[PlannedRequest] = []
        self.model = ""
        self.vocabulary: Vocabulary | None = None
        self.results: Results | None = None
        self.dispatcher: Dispatcher | None = None
        self.worker_parts: set[int] = set()  # master: parts not yet done
        self.worker_plan: dict[str, Any] | None = None  # worker: the master's replay_plan
        self.worker_start = 0.0  # worker: monotonic time of the common start
        self.test_started = False
        self.started = False
        self.failed_setup = False
        self.unreachable = 0  # consecutive requests that got no HTTP answer
        self.stop_reason: str | None = None  # why this runner stopped sending early

    # -- set-up ------------------------------------------------------------------------

    def load(self) -> None:
        """Validate options and read the whole trace (raises before anything is sent)."""
        self.settings.validate()
        self.plan = self.settings.load_plan()

    def discover(self) -> None:
        """Served model and vocabulary, then the counters at the start (in that order:
        probing the vocabulary sends requests that must not count in the run's hit rate)."""
        # First, so that a replay that cannot start still writes a summary saying why.
        self.results = Results(self.settings, planned=len(self.plan))
        client = ServerClient(self.settings.host, api_key=self.settings.api_key)
        try:
            self.model = self.settings.model or client.served_model()
            self.vocabulary = load_vocabulary(self.settings, client, self.model)
            log.info("model %s, %d token ids from %s", self.model,
                     len(self.vocabulary.allowed), self.vocabulary.source)  # fmt: skip
            try:
                self.results.start_counters = client.counters()
            except (requests.RequestException, ValueError) as error:
                log.warning("no prefix-cache counters at start (%s): no hit rate", error)
                self.results.counters_error = str(error)
            self.results.start_wall = time.time()
        finally:
            client.close()

    def mapper(self) -> TokenMapper:
        assert self.vocabulary is not None, "discover() or the master's plan sets it"
        block_tokens = self.settings.block_tokens or self.plan[0].request.block_tokens
        mapper = TokenMapper(self.vocabulary, seed=self.settings.seed, block_tokens=block_tokens)
        log.info("token mapping %s", mapper.fingerprint())
        return mapper

    # -- load generation (local runner and workers) --------------------------------------

    def dispatch(self, part: int, parts: int, start: float, sink: Callable[[dict], None]) -> int:
        """Send this runner's share and wait for its answers; returns the rows produced."""
        mapper = self.mapper()
        session = HttpSession(
            base_url=self.settings.host,
            request_event=self.environment.events.request,
            user=None,
            pool_manager=PoolManager(maxsize=MAX_CONNECTIONS),
        )
        session.headers.update(auth_headers(self.settings.api_key))
        produced = 0

        def send(planned: PlannedRequest, timing: DispatchTiming) -> None:
            nonlocal produced
            row, answered = self._send(session, mapper, planned, timing)
            row["part"] = part
            produced += 1
            sink(row)
            self._count_answer(answered)

        self.dispatcher = Dispatcher(partition(self.plan, part, parts), send)
        self.dispatcher.start(at=start)
        self.dispatcher.join()
        return produced

    def _count_answer(self, answered: bool) -> None:
        """Track requests without an HTTP answer; stop sending after too many in a row."""
        self.unreachable = 0 if answered else self.unreachable + 1
        limit = self.settings.max_unreachable
        if not limit or self.unreachable < limit or self.stop_reason is not None:
            return
        self.stop_reason = (
            f"the server did not answer {limit} requests in a row (connection refused or "
            "lost, or HTTP 502/503/504 from a proxy); requests in flight were abandoned and "
            "the rest of the trace was not sent"
        )
        log.error("stopping the replay: %s", self.stop_reason)
        if self.dispatcher is not None:
            # From a greenlet of its own: stop() kills the dispatcher's greenlets, this one too.
            gevent.spawn(self.dispatcher.stop)

    def _send(
        self,
        session: HttpSession,
        mapper: TokenMapper,
        planned: PlannedRequest,
        timing: DispatchTiming,
    ) -> tuple[dict[str, Any], bool]:
        """Send one request; returns its row and whether the server answered at all."""
        request = planned.request
        prompt = mapper.prompt(request.hash_ids, request.input_length)
        body = completion_body(self.model, prompt, request.output_length)
        expected = body["max_tokens"]
        sent_wall, sent = time.time(), time.perf_counter()
        error: str | None = None
        status: int | None = None
        received = 0
        answered = True
        failure: str | None = None
        with (
            token_timing(self.environment.events.request, COMPLETIONS, sent) as stats,
            session.post(
                COMPLETIONS,
                json=body,
                stream=True,
                catch_response=True,
                name=COMPLETIONS,
                timeout=self.settings.request_timeout_s,
                headers={SESSION_HEADER: planned.session_id},
            ) as response,
        ):
            try:
                status = response.status_code
                if status == 401:
                    raise StreamError(auth_failure(bool(self.settings.api_key)))
                if response.status_code != 200:
                    detail = getattr(response, "error", None) or response.text[:300]
                    raise StreamError(f"HTTP {response.status_code}: {detail}")
                done = False
                for line in response.iter_lines():
                    received += len(line) + 1
                    # Read on to the end of the body after [DONE]: a connection closed
                    # mid-body cannot go back to the pool, and a proxy in front then drops its
                    # own connection to the server too, after every request.
                    if not done:
                        done = not stats.feed_line(line, time.perf_counter())
                if stats.tokens == 0:
                    raise StreamError("empty completion: no token streamed")
                if stats.output_tokens != expected:
                    raise StreamError(f"asked for {expected} tokens, got {stats.output_tokens}")
            except (StreamError, requests.RequestException) as problem:
                error = str(problem)
                response.failure(error)
                # Locust reports a request that got no response as status 0.
                answered = (
                    status != 0
                    and status not in GATEWAY_ERRORS
                    and not isinstance(problem, CONNECTION_LOST)
                )
                failure = failure_kind(status, getattr(response, "error", None) or problem)
            else:
                response.success()
            finally:
                e2e = time.perf_counter() - sent
                # Locust timed the headers only: report the whole stream, and its bytes.
                response.request_meta["response_time"] = e2e * 1000
                response.request_meta["response_length"] = received
        row = {
            "index": request.index,
            "line": request.line,
            "session": planned.session,
            "session_id": planned.session_id,
            "ok": error is None,
            "failure": failure,
            "status": status,
            "error": error,
            "due_s": timing.due_s,
            "ready_s": timing.ready_s,
            "sent_s": timing.sent_s,
            "lag_s": timing.lag_s,
            "held_s": timing.held_s,
            "sent_wall": sent_wall,
            "input_tokens": len(prompt),
            "prompt_tokens": (stats.usage or {}).get("prompt_tokens"),
            "cached_tokens": stats.cached_tokens,
            "expected_output_tokens": expected,
            "output_tokens": stats.output_tokens,
            "finish_reason": stats.finish_reason,
            "ttft_s": stats.ttft,
            "itl_s": stats.itl,
            "e2e_s": e2e,
        }
        return row, answered

    # -- results (local runner and master) -----------------------------------------------

    def finish_results(self) -> dict[str, Any] | None:
        if self.results is None or self.results.summary is not None:
            return None if self.results is None else self.results.summary
        self.results.stop_reason = self.results.stop_reason or self.stop_reason
        end = None
        if self.results.start_counters is not None:
            client = ServerClient(self.settings.host, api_key=self.settings.api_key)
            try:
                end = client.settled_counters()
            except (requests.RequestException, ValueError) as error:
                log.warning("no prefix-cache counters at the end (%s): no hit rate", error)
                self.results.counters_error = str(error)
            finally:
                client.close()
        return self.results.finish(end)

    def exit_code(self) -> int:
        summary = self.results.summary if self.results else None
        if (
            self.failed_setup
            or summary is None
            or summary["requests_failed"]
            or summary["stopped_early"]
        ):
            return 1
        return 0


replay: Replay | None = None
SETUP_ERRORS = (
    TraceError,
    VocabularyError,
    ValueError,
    AuthenticationError,
    requests.RequestException,
)


def _fail_setup(message: str) -> None:
    log.error("replay cannot start: %s", message)
    if replay is not None:
        replay.failed_setup = True
        if replay.results is not None and replay.results.setup_error is None:
            replay.results.setup_error = message


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    global replay
    replay = Replay(environment)
    runner = environment.runner
    if isinstance(runner, MasterRunner) and environment.parsed_options is not None:
        # Locust sends the master's options to every worker in clear: keep the key out.
        environment.parsed_options.api_key = ""
    if isinstance(runner, WorkerRunner):
        runner.register_message("replay_plan", _on_plan)
        return  # options arrive from the master with the first spawn message
    try:
        replay.load()
    except TraceError as error:
        log.error("bad trace, nothing sent: %s", error)
        sys.exit(2)
    except ValueError as error:
        log.error("bad option, nothing sent: %s", error)
        sys.exit(1)
    log.info("trace %s: %d requests", replay.settings.trace, len(replay.plan))
    crowded = crowded_session_warning(
        [planned.session_id for planned in replay.plan], replay.settings.trace
    )
    if crowded is not None:
        log.warning("%s", crowded)
    if isinstance(runner, MasterRunner):
        runner.register_message("replay_row", _on_row)
        runner.register_message("replay_done", _on_done)


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    assert replay is not None, "init did not run"
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        replay.test_started = True  # the master's options are in parsed_options now
        _maybe_start_worker(runner)
    elif isinstance(runner, MasterRunner):
        _start_master(runner)  # before the spawn messages, so workers get the plan first
    else:
        gevent.spawn(_run_local, runner)


def _start_master(runner: MasterRunner) -> None:
    assert replay is not None
    try:
        replay.discover()
    except SETUP_ERRORS as error:
        _fail_setup(str(error))
        gevent.spawn(runner.quit)
        return
    assert replay.vocabulary is not None
    workers = sorted(c.id for c in runner.clients.ready + runner.clients.running)
    replay.worker_parts = set(range(len(workers)))
    for part, client_id in enumerate(workers):
        plan = {
            "part": part,
            "parts": len(workers),
            "delay_s": START_DELAY_S,
            "model": replay.model,
            "allowed": list(replay.vocabulary.allowed),
            "special": sorted(replay.vocabulary.special),
            "source": replay.vocabulary.source,
        }
        runner.send_message("replay_plan", plan, client_id=client_id)


def _run_local(runner: LocalRunner) -> None:
    assert replay is not None
    try:
        replay.discover()
        assert replay.results is not None
        replay.dispatch(0, 1, time.monotonic(), replay.results.add)
    except SETUP_ERRORS as error:
        _fail_setup(str(error))
    replay.finish_results()
    runner.quit()


def _on_plan(environment: Environment, msg: Any, **_: Any) -> None:
    """Worker: the master dealt this worker its part, the model and the vocabulary."""
    assert replay is not None
    replay.worker_plan = msg.data
    replay.worker_start = time.monotonic() + msg.data["delay_s"]
    _maybe_start_worker(environment.runner)


def _maybe_start_worker(runner: WorkerRunner) -> None:
    """Start once both the plan and the spawn message (with the options) have arrived."""
    assert replay is not None
    if replay.worker_plan is None or not replay.test_started or replay.started:
        return
    replay.started = True
    gevent.spawn(_run_worker, runner)


def _run_worker(runner: WorkerRunner) -> None:
    assert replay is not None and replay.worker_plan is not None
    plan = replay.worker_plan
    # The master's options, with this worker's own key (the master never sends one).
    replay.settings = dataclasses.replace(
        ReplaySettings.from_options(
            runner.environment.parsed_options, runner.environment.host or ""
        ),
        api_key=replay.settings.api_key,
    )
    replay.model = plan["model"]
    replay.vocabulary = Vocabulary.build(plan["allowed"], plan["special"], plan["source"])
    produced = 0
    try:
        replay.load()
        produced = replay.dispatch(
            plan["part"],
            plan["parts"],
            replay.worker_start,
            lambda row: runner.send_message("replay_row", row),
        )
    except SETUP_ERRORS as error:
        _fail_setup(str(error))
    done = {
        "part": plan["part"],
        "rows": produced,
        "ok": not replay.failed_setup,
        "stopped_early": replay.stop_reason,
    }
    runner.send_message("replay_done", done)


def _on_row(msg: Any, **_: Any) -> None:
    assert replay is not None and replay.results is not None
    replay.results.add(msg.data)


def _on_done(environment: Environment, msg: Any, **_: Any) -> None:
    assert replay is not None
    if not msg.data["ok"]:
        _fail_setup(f"worker part {msg.data['part']} failed to start")
    if msg.data.get("stopped_early") and replay.results is not None:
        replay.results.stop_reason = f"worker part {msg.data['part']}: {msg.data['stopped_early']}"
    replay.worker_parts.discard(msg.data["part"])
    if not replay.worker_parts:
        replay.finish_results()
        gevent.spawn(environment.runner.quit)


@events.test_stop.add_listener
def _on_test_stop(**_: Any) -> None:
    if replay is not None and replay.dispatcher is not None:
        replay.dispatcher.stop()


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_: Any) -> None:
    if replay is None or isinstance(environment.runner, WorkerRunner):
        return
    replay.finish_results()  # run time over: summarize what was answered
    environment.process_exit_code = replay.exit_code()
