"""Pace a replay to the machine it runs on: measure the server, then choose the trace's speed.

A trace replayed at fixed timestamps overloads a slow machine (requests queue without bound,
the run times out) and idles a fast one, and how many requests overlap in time, and so which
prefixes are still cached when the next request comes, depends on the machine. So the demos
first time the real server (``measure_cost``), then stretch or compress the trace so that the
offered work is a fixed share of what the server can do (``pace``): the same trace keeps the
same overlap, and so the same hit rates, on any machine. ``ProgressReporter`` prints what a
replay has answered so far, with an estimate of the time left.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from arc_serving_common.traces import TraceRequest
from arc_simulator.simulate import CostModel

# Offered work as a share of one server's measured capacity: busy enough that requests
# overlap and batch, far enough from saturation that queues stay short on a noisy machine.
TARGET_UTILIZATION = 0.5
CALIBRATION_ROUNDS = 3
DECODE_PROBE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Pace:
    """The replay speed chosen for one trace on one machine.

    ``time_scale`` multiplies the trace's timestamps; ``work_s`` is the serial service time
    the trace asks of the servers at the cost model, ``duration_s`` the replay's scheduled
    length after scaling, and ``utilization`` their ratio per server.
    """

    time_scale: float
    work_s: float
    duration_s: float
    servers: int

    @property
    def utilization(self) -> float:
        return self.work_s / (self.duration_s * self.servers) if self.duration_s > 0 else math.inf

    def deadline_s(self) -> int:
        """Locust's run time: the schedule, then all the work done serially, twice over.

        A replay ends as soon as every request is answered, so a generous bound costs nothing;
        it only stops a run whose server stopped answering.
        """
        return int(self.duration_s + 2 * self.work_s + 120)


def parse_time_scale(text: str) -> float | None:
    """``--time-scale``: ``auto`` (None: pace to the measured server) or a factor in (0, 100]."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 100:
        raise ValueError(f"--time-scale must be auto or in (0, 100], got {text!r}")
    return value


TIME_SCALE_HELP = (
    "multiply the trace's timestamps (0.5 sends twice as fast); default auto: time the "
    "servers first and keep them busy about half the time"
)


def service_seconds(request: TraceRequest, cost: CostModel, hit_rate: float) -> float:
    """One request's serial service time with ``hit_rate`` of its prompt already cached."""
    prompt = request.input_length * (1.0 - hit_rate)
    return (
        cost.step_seconds
        + prompt * cost.prefill_seconds_per_token
        + request.output_length * cost.decode_seconds_per_token
    )


def pace(
    requests: Sequence[TraceRequest],
    cost: CostModel,
    hit_rate: float,
    *,
    servers: int = 1,
    utilization: float = TARGET_UTILIZATION,
    time_scale: float | None = None,
) -> Pace:
    """The time scale at which ``requests`` keep ``servers`` busy ``utilization`` of the time.

    ``hit_rate`` is the share of prompt tokens expected cached (the baseline policy's
    prediction: the busiest run sets the pace for all, so every policy replays the same
    schedule). A given ``time_scale`` is kept as it is, and only the load it offers computed.
    """
    if not requests:
        raise ValueError("pace needs at least one request")
    if not 0 < utilization < 1:
        raise ValueError(f"utilization must be in (0, 1), got {utilization}")
    if servers < 1:
        raise ValueError(f"servers must be at least 1, got {servers}")
    work = sum(service_seconds(r, cost, hit_rate) for r in requests)
    span = requests[-1].timestamp_s - requests[0].timestamp_s
    if time_scale is None:
        time_scale = work / (span * servers * utilization) if span > 0 else 1.0
    return Pace(time_scale, work, span * time_scale, servers)


class Calibration:
    """What ``measure_cost`` times: medians of a few real requests, in seconds.

    ``miss_s``: an uncached prompt of ``prompt_tokens`` with one output token; ``hit_s``: the
    same prompt again, cached; ``decode_s``: one more output token on a cached prompt.
    """

    def __init__(self, prompt_tokens: int, miss_s: float, hit_s: float, decode_s: float):
        self.prompt_tokens = prompt_tokens
        self.miss_s = miss_s
        self.hit_s = hit_s
        self.decode_s = decode_s

    def cost_model(self) -> CostModel:
        prefill = max(self.miss_s - self.hit_s, 0.0) / self.prompt_tokens
        return CostModel(
            prefill_seconds_per_token=max(prefill, 1e-7),
            decode_seconds_per_token=max(self.decode_s, 1e-6),
            step_seconds=self.hit_s,
        )

    def describe(self) -> str:
        return (
            f"{self.prompt_tokens}-token prompt uncached {self.miss_s * 1000:.0f} ms, cached "
            f"{self.hit_s * 1000:.0f} ms; {self.decode_s * 1000:.1f} ms per output token"
        )


def _calibration_prompts(
    prompt_tokens: int, vocabulary: int, first: int, count: int
) -> list[list[int]]:
    # Distinct leading tokens per prompt, so no prompt hits another's blocks.
    return [
        [4 + (7 * n + 13 * i + n * i) % vocabulary for i in range(prompt_tokens)]
        for n in range(first, first + count)
    ]


def warm_long_prompts(
    complete: Callable[[list[int], int], None], lengths: Sequence[int] = (1_500, 1_000, 500)
) -> None:
    """Serve, untimed, one prompt of each length: the first long prompts of a fresh vLLM
    server process are slower than later ones, and no run may pay for them."""
    for length in lengths:
        complete([4 + i % 1000 for i in range(length)], 8)


def warm_up(
    complete: Callable[[list[int], int], None],
    prompt_tokens: int,
    *,
    vocabulary: int = 1_000,
    rounds: int = CALIBRATION_ROUNDS,
) -> None:
    """Serve, untimed, what ``measure_cost`` times: uncached and cached prompts of
    ``prompt_tokens`` and a short decode.

    A fresh vLLM CPU server runs its first requests of a length several times slower than
    later ones (measured: a 758-token prefill at 230 ms first, 43 ms from then on); timed
    cold, that one-time set-up would read as the server's cost and pace the replay too slowly.
    Uses prompts ``measure_cost`` never sends, and leaves them cached.
    """
    prompts = _calibration_prompts(prompt_tokens, vocabulary, rounds + 1, rounds)
    for max_tokens in (1, 1, 1 + DECODE_PROBE_TOKENS):
        for prompt in prompts:
            complete(prompt, max_tokens)


def measure_cost(
    complete: Callable[[list[int], int], None],
    prompt_tokens: int,
    *,
    vocabulary: int = 1_000,
    rounds: int = CALIBRATION_ROUNDS,
) -> Calibration:
    """Time real completions through ``complete(prompt_ids, max_tokens)``, one at a time,
    after a ``warm_up`` of the same server.

    Leaves ``2 * rounds`` prompts in the server's prefix cache: empty it before a measured run.
    """
    if prompt_tokens < 2:
        raise ValueError(f"prompt_tokens must be at least 2, got {prompt_tokens}")
    warm_up(complete, prompt_tokens, vocabulary=vocabulary, rounds=rounds)

    def timed(prompt: list[int], max_tokens: int) -> float:
        started = time.perf_counter()
        complete(prompt, max_tokens)
        return time.perf_counter() - started

    prompts = _calibration_prompts(prompt_tokens, vocabulary, 1, rounds)
    miss = statistics.median(timed(p, 1) for p in prompts)
    hit = statistics.median(timed(p, 1) for p in prompts)
    longer = statistics.median(timed(p, 1 + DECODE_PROBE_TOKENS) for p in prompts)
    return Calibration(prompt_tokens, miss, hit, max(longer - hit, 0.0) / DECODE_PROBE_TOKENS)


class ProgressReporter:
    """Prints ``answered/total`` and an estimate of the time left while a replay runs.

    ``answered()`` reads a counter that only grows during the replay (the servers' finished
    requests since the replay began); a failing read is reported on its line and skipped.
    ``scheduled_s`` is when the replay sends its last request: until then the time left is
    the schedule's, after it the answers still owed. Use as a context manager around the
    blocking replay call.
    """

    def __init__(
        self,
        label: str,
        total: int,
        answered: Callable[[], int],
        *,
        scheduled_s: float,
        print_line: Callable[[str], None] = print,
        interval_s: float = 15.0,
    ) -> None:
        self.label = label
        self.total = total
        self.answered = answered
        self.scheduled_s = scheduled_s
        self.print_line = print_line
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{label}", daemon=True)
        self._started = 0.0

    def line(self, done: int, elapsed_s: float) -> str:
        text = f"{self.label}: {done}/{self.total} requests answered after {elapsed_s:.0f} s"
        if done >= self.total:
            return text
        if elapsed_s < self.scheduled_s:
            return text + f", the last one is sent in {self.scheduled_s - elapsed_s:.0f} s"
        return text + f", all sent, {self.total - done} awaited"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                done = self.answered()
            except Exception as exc:  # a progress line must never end the replay
                self.print_line(f"{self.label}: progress unavailable ({exc})")
                continue
            self.print_line(self.line(done, time.monotonic() - self._started))

    def __enter__(self) -> ProgressReporter:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
