"""``make demo``: the real vLLM (CPU build) with the arc_evictor plugin: LRU, ARC and TRIO,
and the same server without the plugin (stock vLLM).

Steps (each printed with its wall time):

1. Generate a document-QA trace (Qwen-Bailian form, 32-token blocks = the server's block
   size, Zipf over documents, fixed seed) and predict each policy's block hit rate with the
   simulator at the same capacity, in sequential and overlapping mode.
2. Build a small local Llama (random weights, local tokenizer; nothing is downloaded).
3. Start one vLLM server with the plugin, a cache of ``capacity + 1`` blocks (block 0 is
   vLLM's null block) and the policy file ``policy.json`` (``ARC_EVICTOR_CONFIG``).
4. Time the server (``arc_dev.pacing``): an uncached and a cached prompt of the trace's mean
   length, and decode steps. From that, replay the trace at the speed that keeps the server
   busy half the time (``--time-scale auto``), so that as many requests overlap on a slow
   machine as on a fast one and the hit rates do not depend on the machine; the overlapping
   prediction is redone at that speed with the measured service times.
5. For each policy in turn: rewrite the policy file and wait until the engine reports the
   switch (``arc_evictor_policy_info``), empty the prefix cache (``POST /reset_prefix_cache``,
   which also clears the policy's state, ghosts included), then replay the whole trace with
   the real Locust, headless. Every policy therefore starts from an empty cache on the same
   trace, on the same warm server process. Progress (requests answered, time left) is printed
   every 15 seconds.
6. Stop that server and start the same one without the plugin (no ``ARC_EVICTOR_*`` variable:
   vLLM as shipped, its own LRU free queue), time nothing anew, empty its cache and replay the
   same trace at the same pace: the ``stock`` row, what the plugin costs a user. Its block hit
   rate must equal the plugin's ``lru`` within half a point (the same policy); vLLM's own
   counters give it (hit tokens over the server's block size, over the trace's full prompt
   blocks, which are what the plugin counts as queries).
7. Print one table (measured next to predicted hit rates, each policy's TTFT p50 against stock
   and against the baseline), the gain lines against the first policy and the targets, and
   write ``demo.png`` and ``demo.json``.
8. A real Prometheus (``.tools/bin/prometheus``, from ``make tools``) scrapes the plugin's
   server as the chart's PodMonitor does by default (every 15 s), during its runs;
   ``dashboards.png`` draws the chart's main Grafana dashboard (``arc_dev.snapshot``) from its
   range queries over the runs: hit rate and TTFT over time per policy, as Grafana would show
   them. ``demo.json`` lists when each live switch was written and reported, and the
   policy-switch annotation's marks; a switch without exactly one mark within one scrape and
   one annotation step after it is printed as a warning. Without the binary the demo says so
   and skips this picture.

The default policies are LRU (the baseline), ARC and TRIO, the chart's default policy.

Invariant: a run is only reported when every request of the trace was sent and answered;
otherwise the demo stops with exit status 1 and says which policy's replay failed and why.
Bad arguments stop it with status 2 before anything is written or started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from arc_dev.pacing import (
    TIME_SCALE_HELP,
    Pace,
    ProgressReporter,
    measure_cost,
    pace,
    parse_time_scale,
    warm_long_prompts,
)
from arc_dev.snapshot import AnnotationEvent, Switch, snapshot, switch_mark_problems
from arc_evictor.policies import policy_names
from arc_harness.prometheus import (
    PROMETHEUS_BINARY,
    EngineTarget,
    PrometheusError,
    PrometheusServer,
    load_dashboard,
    pod_monitor_job,
)
from arc_harness.vllm_server import VllmServer, write_policy_file
from arc_serving_common.names import CONFIG_ENV, POLL_MS_ENV
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.generate import DocQAParams, docqa, write_generated
from arc_simulator.simulate import CostModel, simulate

BLOCK_TOKENS = 32  # vLLM's CPU build needs a multiple of 32; the trace uses the same blocks
# 60 documents of ~800 tokens, 300 questions (3 requests/s before pacing), Zipf 1.1. At 320
# cached blocks (about 12 average documents) the simulator predicts ARC 9 points above LRU
# (0.56 -> 0.65) in both modes for this seed (seeds 0-4 all show 3 to 9 points), and about
# half the requests' prefills saved: the median request moves from a miss to a hit.
TRACE = DocQAParams(
    documents=60,
    document_tokens=800,
    questions_per_document=5.0,
    zipf_exponent=1.1,
    question_tokens=32,
    output_tokens=8,
    requests_per_second=3.0,
    seed=4,
)
CAPACITY_BLOCKS = 320
MAX_MODEL_LEN = 2_048
# Hidden 512, 4 layers, 8 heads of 64: an uncached 1,000-token prefill takes about 0.2 s on
# 2 CPU cores against about 0.02 s for a cached one, so cache hits show in TTFT.
MODEL = {"hidden_size": 512, "num_layers": 4, "num_heads": 8}
# The simulator's overlapping mode before the server is timed (``--simulate-only``): service
# times of that model on one 2-core machine with AMX. A run replaces them with its own.
COST = CostModel(
    prefill_seconds_per_token=0.22e-3, decode_seconds_per_token=0.008, step_seconds=0.02
)
POLL_MS = 100  # how often the plugin checks the policy file (default 500)
SWITCH_TIMEOUT_S = 60.0
RESET_TIMEOUT_S = 30.0
TTFT_SHARE_TARGET = 0.5  # TTFT p50 gain must be at least half the hit-rate gain
DISPATCH_LAG_P99_TARGET_S = 0.050
SERVER_NICE = 5  # see _BackgroundServer
STOCK = "stock"  # the row of the server without the plugin
PLUGIN_ENV_PREFIX = "ARC_EVICTOR_"  # every setting of the plugin; none reaches the stock server
STOCK_HIT_TOLERANCE = 0.005  # stock and the plugin's lru make the same decisions
# LRU is the baseline the gains are measured against; TRIO is the chart's default policy.
DEFAULT_POLICIES = ("lru", "arc", "trio")
# The chart's default PodMonitor interval: Grafana's rate window is then 4 scrapes (60 s), which
# holds enough of the trace's requests for a readable hit rate.
SCRAPE_INTERVAL_S = 15.0
# vLLM's counter of finished requests (every finish reason): the replay's progress.
FINISHED_REQUESTS = "vllm:request_success_total"
# vLLM's prefix-cache hits in tokens: whole blocks for full attention, so the stock server's
# hit blocks are this over the block size.
PREFIX_HIT_TOKENS = "vllm:prefix_cache_hits_total"
# How the demo's engine appears to Prometheus: as a pod of the chart's default release.
DEMO_NAMESPACE, DEMO_POD, DEMO_SERVINGPOLICY = "arc-serving", "arc-demo-engine-0", "arc-demo"


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


class StepClock:
    """Prints each step with the wall time since the demo started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def step(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """What one demo run does; ``parse_args`` builds it and checks every field."""

    out: Path
    policies: tuple[str, ...] = DEFAULT_POLICIES
    capacity_blocks: int = CAPACITY_BLOCKS
    trace: DocQAParams = TRACE
    time_scale: float | None = None  # None: paced to the measured server (arc_dev.pacing)
    simulate_only: bool = False
    stock: bool = True  # also replay on the server without the plugin


@dataclass(frozen=True, slots=True)
class Prediction:
    """The simulator's block hit rates for one policy at the demo's capacity."""

    policy: str
    sequential: float
    overlapping: float
    ttft_p50_s: float | None
    cost: CostModel | None = None


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One scrape of the server's counters: vLLM's own, and the plugin's where it runs
    (zero and None without it)."""

    requests_finished: float
    prefix_hit_tokens: float  # vLLM's vllm:prefix_cache_hits_total
    block_queries: float = 0.0
    block_hits: float = 0.0
    active_policy: str | None = None


@dataclass(slots=True)
class PolicyRun:
    """One policy's replay: the load test's summary and the plugin's block counts."""

    policy: str
    summary: dict[str, Any]
    block_queries: float
    block_hits: float
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return int(self.summary["requests_ok"])

    @property
    def block_hit_rate(self) -> float | None:
        """Committed hit blocks over full prompt blocks (None when nothing was queried)."""
        return self.block_hits / self.block_queries if self.block_queries else None

    @property
    def ttft_p50_s(self) -> float | None:
        return self.summary["ttft_s"]["p50"]

    @property
    def ttft_p90_s(self) -> float | None:
        return self.summary["ttft_s"]["p90"]

    @property
    def itl_p50_s(self) -> float | None:
        return self.summary["itl_s"]["p50"]

    @property
    def throughput_rps(self) -> float | None:
        return self.summary["throughput_rps"]

    @property
    def token_hit_rate(self) -> float | None:
        return self.summary["prefix_cache"]["hit_rate"]

    @property
    def dispatch_lag_p99_s(self) -> float | None:
        return self.summary["dispatch_lag_s"]["p99"]


# ------------------------------------------------------------------------- arguments
def policy_list(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    """The policy names of comma-separated ``text``, lower-cased; an unknown one stops the
    command through ``parser.error`` (status 2) with the valid names."""
    policies = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    valid = policy_names()
    unknown = [name for name in policies if name not in valid]
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}; valid policies: {', '.join(valid)}")
    return policies


def add_run_arguments(
    parser: argparse.ArgumentParser,
    out: Path,
    capacity_blocks: int,
    seed: int,
    *,
    policies_help: str,
) -> None:
    """``--out``, ``--policies`` (default ``DEFAULT_POLICIES``), ``--capacity`` and ``--seed``
    with these defaults (``policy_list`` and ``check_run_arguments`` check them)."""
    parser.add_argument("--out", type=Path, default=out, help="output folder")
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"{policies_help} (default: {','.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--capacity",
        type=int,
        default=capacity_blocks,
        help=f"cacheable blocks of {BLOCK_TOKENS} tokens (the engine gets one more, vLLM's "
        f"null block; default {capacity_blocks})",
    )
    parser.add_argument("--seed", type=int, default=seed, help="trace seed")


def check_run_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, max_model_len: int
) -> None:
    """``--capacity`` (one ``max_model_len`` request must fit), ``--seed`` and ``--out``, as
    every demo that starts vLLM takes them; ``parser.error`` (status 2) names a bad one."""
    min_capacity = -(-max_model_len // BLOCK_TOKENS)
    if args.capacity < min_capacity:
        parser.error(
            f"--capacity must be at least {min_capacity} blocks (one {max_model_len}-token "
            f"request must fit, or vLLM refuses to start), got {args.capacity}"
        )
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")


def parse_args(argv: Sequence[str] | None = None) -> DemoSettings:
    """Parse and check the command line; exits with status 2 and a message on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m arc_dev.demo", description=__doc__.splitlines()[0]
    )
    add_run_arguments(
        parser, Path("out/demo"), CAPACITY_BLOCKS, TRACE.seed,
        policies_help="comma-separated policies, replayed in this order; the first is the "
        "baseline the gains are measured against",
    )  # fmt: skip
    parser.add_argument("--time-scale", default="auto", help=TIME_SCALE_HELP)
    parser.add_argument(
        "--no-stock",
        action="store_true",
        help="skip the replay on the same server without the plugin (the stock row)",
    )
    parser.add_argument(
        "--simulate-only",
        action="store_true",
        help="generate the trace and print the simulator's prediction, start no server",
    )
    args = parser.parse_args(argv)
    policies = policy_list(parser, args.policies)
    if len(policies) < 2 or len(set(policies)) != len(policies):
        parser.error(f"--policies needs at least two distinct policies, got {args.policies!r}")
    check_run_arguments(parser, args, MAX_MODEL_LEN)
    try:
        time_scale = parse_time_scale(args.time_scale)
    except ValueError as exc:
        parser.error(str(exc))
    return DemoSettings(
        out=args.out,
        policies=policies,
        capacity_blocks=args.capacity,
        trace=replace(TRACE, seed=args.seed),
        time_scale=time_scale,
        simulate_only=args.simulate_only,
        stock=not args.no_stock,
    )


# --------------------------------------------------------------------- simulation
def predict(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    capacity: int,
    cost: CostModel | None = COST,
) -> list[Prediction]:
    """Each policy's simulated block hit rate at ``capacity``, sequential and overlapping
    (with ``cost``'s service times; None predicts the sequential mode only)."""
    predictions = []
    for name in policies:
        sequential = simulate(requests, name, capacity, sequential=True)
        if cost is None:
            predictions.append(Prediction(name, sequential.block_hit_rate, math.nan, None, None))
            continue
        overlapping = simulate(requests, name, capacity, sequential=False, cost=cost)
        predictions.append(
            Prediction(name, sequential.block_hit_rate, overlapping.block_hit_rate,
                       overlapping.ttft_p50_s, cost)
        )  # fmt: skip
    return predictions


def cost_of(predictions: Sequence[Prediction]) -> CostModel:
    """The service times the predictions' overlapping mode used."""
    costs = {p.cost for p in predictions}
    if len(costs) != 1 or None in costs:
        raise ValueError("the predictions do not share one cost model")
    return next(iter(costs))


# ------------------------------------------------------------------------ reports
def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def aligned_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = []
    for number, row in enumerate(rows):
        cells = [cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in
                 enumerate(row)]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _ratio(value: float | None, reference: float | None) -> str:
    return "-" if value is None or not reference else f"{value / reference:.2f}x"


def predicted_as(policy: str) -> str:
    """The simulated policy a row stands for: stock vLLM evicts least recently used first."""
    return "lru" if policy == STOCK else policy


def comparison_table(
    runs: Sequence[PolicyRun], predictions: Sequence[Prediction], stock: PolicyRun | None = None
) -> str:
    """One row per policy (stock first when measured): measured figures, the simulator's hit
    rates next to them, and TTFT p50 over stock's and over the baseline's (the first run)."""
    predicted = {p.policy: p for p in predictions}
    baseline = runs[0] if runs else None
    rows = [
        [
            "policy",
            "requests",
            "block hit",
            "sim seq",
            "sim ovl",
            "token hit",
            "TTFT p50 ms",
            "TTFT p90 ms",
            f"p50/{STOCK}",
            f"p50/{baseline.policy if baseline else '-'}",
            "ITL p50 ms",
            "req/s",
            "lag p99 ms",
        ]
    ]
    for run in ([stock] if stock else []) + list(runs):
        prediction = predicted.get(predicted_as(run.policy))
        throughput = run.throughput_rps
        rows.append(
            [
                run.policy,
                f"{run.requests:,}",
                _rate(run.block_hit_rate),
                _rate(prediction.sequential if prediction else None),
                _rate(prediction.overlapping if prediction else None),
                _rate(run.token_hit_rate),
                _ms(run.ttft_p50_s),
                _ms(run.ttft_p90_s),
                _ratio(run.ttft_p50_s, stock.ttft_p50_s if stock else None),
                _ratio(run.ttft_p50_s, baseline.ttft_p50_s if baseline else None),
                _ms(run.itl_p50_s),
                "-" if throughput is None else f"{throughput:.2f}",
                _ms(run.dispatch_lag_p99_s),
            ]
        )
    return aligned_table(rows)


def prediction_table(predictions: Sequence[Prediction]) -> str:
    """The simulator's view alone (``--simulate-only``)."""
    rows = [["policy", "sim seq", "sim ovl", "model TTFT p50 ms"]]
    for p in predictions:
        rows.append([p.policy, _rate(p.sequential), _rate(p.overlapping), _ms(p.ttft_p50_s)])
    return aligned_table(rows)


@dataclass(frozen=True, slots=True)
class Gain:
    """One policy against the baseline, from the same demo run.

    ``hit_points`` is the block-hit-rate difference in points, ``hit_relative`` that
    difference over the baseline's rate, ``ttft_p50_relative`` the baseline's TTFT p50 minus
    the policy's, over the baseline's (positive = faster).
    """

    policy: str
    baseline: str
    hit_points: float
    hit_relative: float | None
    ttft_p50_relative: float | None

    @property
    def beats_baseline(self) -> bool:
        return self.hit_points > 0

    @property
    def ttft_target_met(self) -> bool | None:
        """TTFT p50 gain >= half the relative hit-rate gain (None: no win or no figures)."""
        if not self.beats_baseline or self.hit_relative is None or self.ttft_p50_relative is None:
            return None
        return self.ttft_p50_relative >= TTFT_SHARE_TARGET * self.hit_relative


def gains(runs: Sequence[PolicyRun]) -> list[Gain]:
    """Every run after the first against the first (the baseline)."""
    if len(runs) < 2:
        raise ValueError("gains need a baseline run and at least one more")
    base = runs[0]
    result = []
    for run in runs[1:]:
        if base.block_hit_rate is None or run.block_hit_rate is None:
            raise ValueError(f"no block queries were counted for {base.policy} or {run.policy}")
        points = 100 * (run.block_hit_rate - base.block_hit_rate)
        relative = (
            (run.block_hit_rate - base.block_hit_rate) / base.block_hit_rate
            if base.block_hit_rate > 0
            else None
        )
        ttft = (
            (base.ttft_p50_s - run.ttft_p50_s) / base.ttft_p50_s
            if base.ttft_p50_s and run.ttft_p50_s is not None
            else None
        )
        result.append(Gain(run.policy, base.policy, points, relative, ttft))
    return result


def signed_percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def gain_lines(runs: Sequence[PolicyRun]) -> list[str]:
    """The hit gain, TTFT p50 gain and target lines under the table."""
    lines = []
    for gain in gains(runs):
        lines.append(
            f"hit gain ({gain.policy} vs {gain.baseline}): {gain.hit_points:+.1f} points of "
            f"block hit rate, {signed_percent(gain.hit_relative)} relative"
        )
        lines.append(
            f"TTFT p50 gain ({gain.policy} vs {gain.baseline}): "
            f"{signed_percent(gain.ttft_p50_relative)} (positive = faster)"
        )
        met = gain.ttft_target_met
        if met is None:
            verdict = f"not applicable: {gain.policy} did not beat {gain.baseline}'s hit rate"
            if gain.beats_baseline:
                verdict = "not applicable: a figure is missing"
        else:
            needed = TTFT_SHARE_TARGET * (gain.hit_relative or 0.0)
            verdict = (
                f"{'met' if met else 'MISSED'}: needs >= {100 * needed:.1f}% (half of "
                f"{signed_percent(gain.hit_relative)}), got "
                f"{signed_percent(gain.ttft_p50_relative)}"
            )
        lines.append(f"target TTFT p50 gain >= half the hit gain: {verdict}")
    worst = max(
        (run.dispatch_lag_p99_s for run in runs if run.dispatch_lag_p99_s is not None),
        default=None,
    )
    if worst is not None:
        state = "met" if worst < DISPATCH_LAG_P99_TARGET_S else "MISSED"
        lines.append(
            f"target dispatch lag p99 < {DISPATCH_LAG_P99_TARGET_S * 1000:.0f} ms: {state} "
            f"(worst run {worst * 1000:.1f} ms)"
        )
    return lines


def stock_lines(stock: PolicyRun, runs: Sequence[PolicyRun]) -> list[str]:
    """The stock row against the plugin's: its hit rate against ``lru``'s (the same policy,
    so within ``STOCK_HIT_TOLERANCE``), and each policy's TTFT p50 against it."""
    lines = []
    lru = next((run for run in runs if run.policy == "lru"), None)
    if lru is not None and lru.block_hit_rate is not None and stock.block_hit_rate is not None:
        points = 100 * (lru.block_hit_rate - stock.block_hit_rate)
        met = abs(points) <= 100 * STOCK_HIT_TOLERANCE
        lines.append(
            f"target {STOCK} block hit rate = the plugin's lru within "
            f"{100 * STOCK_HIT_TOLERANCE:.1f} point: {'met' if met else 'MISSED'} "
            f"({stock.block_hit_rate:.3f} vs {lru.block_hit_rate:.3f}, {points:+.2f} points)"
        )
    for run in runs:
        if stock.ttft_p50_s and run.ttft_p50_s is not None:
            change = (run.ttft_p50_s - stock.ttft_p50_s) / stock.ttft_p50_s
            lines.append(
                f"TTFT p50 {run.policy} vs {STOCK}: {signed_percent(change)} "
                f"({'slower' if change > 0 else 'faster'}), p90 "
                f"{_ratio(run.ttft_p90_s, stock.ttft_p90_s)} of {STOCK}'s"
            )
    return lines


def plot_comparison(
    runs: Sequence[PolicyRun], predictions: Sequence[Prediction], path: Path, title: str
) -> Path:
    """Bars per run (``stock`` included when measured): measured and predicted block hit
    rate; measured TTFT p50 and p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    predicted = {p.policy: p for p in predictions}
    names = [run.policy for run in runs]
    simulated = [predicted.get(predicted_as(name)) for name in names]
    x = np.arange(len(names))
    figure, (hits, ttft) = plt.subplots(1, 2, figsize=(10, 4.2))
    series = [
        ("measured (vLLM)", [run.block_hit_rate or 0.0 for run in runs]),
        ("simulated, sequential", [p.sequential if p else 0.0 for p in simulated]),
        ("simulated, overlapping", [p.overlapping if p else 0.0 for p in simulated]),
    ]
    width = 0.8 / len(series)
    for number, (label, values) in enumerate(series):
        bars = hits.bar(x + (number - 1) * width, values, width, label=label)
        hits.bar_label(bars, fmt="%.3f", fontsize=7)
    hits.set_xticks(x, names)
    hits.set_ylabel("block hit rate")
    hits.set_ylim(0, 1)
    hits.set_title("prefix-cache block hit rate")
    hits.legend(fontsize=8)
    for number, (label, values) in enumerate(
        [
            ("TTFT p50", [1000 * (run.ttft_p50_s or 0.0) for run in runs]),
            ("TTFT p90", [1000 * (run.ttft_p90_s or 0.0) for run in runs]),
        ]
    ):
        bars = ttft.bar(x + (number - 0.5) * 0.4, values, 0.4, label=label)
        ttft.bar_label(bars, fmt="%.0f", fontsize=7)
    ttft.set_xticks(x, names)
    ttft.set_ylabel("ms")
    ttft.set_title("time to first token (measured)")
    ttft.legend(fontsize=8)
    for axes in (hits, ttft):
        axes.grid(axis="y", alpha=0.3)
    return save_figure(figure, path, title)


TITLE_WIDTH_SHARE = 0.95  # of the figure's width: a title wider is broken into lines


def save_figure(figure: Any, path: Path, title: str) -> Path:
    """Title ``figure`` (in as many lines as it needs to fit ``TITLE_WIDTH_SHARE`` of its
    width), write it to ``path`` as PNG (folders made) and free it."""
    import matplotlib.pyplot as plt

    text = figure.suptitle(title, fontsize=10)
    width = text.get_window_extent(figure.canvas.get_renderer()).width
    room = TITLE_WIDTH_SHARE * figure.bbox.width
    if width > room:
        text.set_text(textwrap.fill(title, max(20, int(len(title) * room / width))))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# -------------------------------------------------------------------- the server
def parse_counters(text: str, *, plugin: bool = True) -> EngineCounters:
    """vLLM's counters, and with ``plugin`` the plugin's block counters (summed over label
    sets) and active policy, from /metrics. Raises DemoError when the plugin's metrics are
    missing from a server that should run it, or present on one that should not."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"arc_evictor_block_queries_total": 0.0, "arc_evictor_block_hits_total": 0.0}
    seen = set()
    active = None
    finished = hit_tokens = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == FINISHED_REQUESTS:
                finished += sample.value
            elif sample.name == PREFIX_HIT_TOKENS:
                hit_tokens += sample.value
            elif sample.name in totals:
                totals[sample.name] += sample.value
                seen.add(sample.name)
            elif sample.name == "arc_evictor_policy_info" and sample.value == 1:
                active = sample.labels.get("policy")
    if not plugin:
        if seen:
            raise DemoError(
                f"the {STOCK} server's /metrics has {', '.join(sorted(seen))}: the plugin runs "
                f"there (an {CONFIG_ENV} or ARC_EVICTOR_POLICY variable reached it)"
            )
        return EngineCounters(finished, hit_tokens)
    missing = sorted(set(totals) - seen)
    if missing:
        raise DemoError(
            f"the server's /metrics has no {', '.join(missing)}: is the arc_evictor plugin "
            f"active ({CONFIG_ENV} set) and PROMETHEUS_MULTIPROC_DIR set?"
        )
    return EngineCounters(
        finished,
        hit_tokens,
        totals["arc_evictor_block_queries_total"],
        totals["arc_evictor_block_hits_total"],
        active,
    )


class ServerSession:
    """The demo's calls to one running server: switch policy, empty the cache, scrape.

    ``policy_file`` None is the stock server, without the plugin: it has no policy to switch.

    Invariant: after ``prepare(name)`` returns, the engine runs policy ``name`` (``stock``:
    vLLM's own) and its prefix cache (and the policy's state, ghost lists included) is empty;
    ``switches`` lists every change of policy it made, in order.
    """

    def __init__(
        self, base_url: str, model: str, policy_file: Path | None, api_key: str | None = None
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.policy_file = policy_file
        self.api_key = api_key  # the server's key: every request sends it (not only /v1)
        self.switches: list[Switch] = []

    @property
    def plugin(self) -> bool:
        return self.policy_file is not None

    def _request(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path,
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
        )
        try:
            # base_url is the demo's own server, http://127.0.0.1:PORT, never user input.
            with urllib.request.urlopen(request, timeout=120) as response:  # nosec B310
                return response.read()
        except (urllib.error.URLError, OSError) as exc:
            raise DemoError(f"{path} on {self.base_url} failed: {exc}") from exc

    def complete(self, prompt: list[int], max_tokens: int = 1) -> None:
        """One non-streamed completion of ``prompt`` (token ids)."""
        self._request(
            "/v1/completions",
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
             "min_tokens": max_tokens, "ignore_eos": True},
        )  # fmt: skip

    def counters(self) -> EngineCounters:
        return parse_counters(self._request("/metrics").decode(), plugin=self.plugin)

    def write_policy(self, name: str) -> None:
        """Replace the policy file atomically, so the plugin never reads half a file."""
        if self.policy_file is None:
            raise DemoError(f"the {STOCK} server has no policy file; cannot switch to {name!r}")
        write_policy_file(self.policy_file, name)

    def prepare(self, name: str) -> None:
        """Switch the engine to ``name`` (waiting until it reports it), then empty the cache;
        on the stock server (``name`` ``stock``) only empty the cache."""
        if name == STOCK and not self.plugin:
            self.reset_cache()
            return
        running = self.counters().active_policy
        written = time.time()
        self.write_policy(name)
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        # The plugin checks the file between scheduler steps: a request makes steps happen.
        while self.counters().active_policy != name:
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the engine did not switch to {name!r} within {SWITCH_TIMEOUT_S:.0f}s "
                    f"(policy file {self.policy_file})"
                )
            self.complete([4, 5, 6, 7])
            time.sleep(POLL_MS / 1000)
        if running != name:
            self.switches.append(Switch(name, written, time.time()))
        self.reset_cache()

    def reset_cache(self) -> None:
        """Empty vLLM's prefix cache (``POST /reset_prefix_cache``), retrying while refused."""
        deadline = time.monotonic() + RESET_TIMEOUT_S
        while not json.loads(self._request("/reset_prefix_cache", {}))["success"]:
            # vLLM refuses while blocks are held (a request still finishing): retry.
            if time.monotonic() > deadline:
                raise DemoError(f"vLLM refused to reset the prefix cache for {RESET_TIMEOUT_S}s")
            time.sleep(0.5)


def replay_policy(
    session: ServerSession,
    name: str,
    trace: Path,
    out: Path,
    *,
    tokenizer: Path,
    time_scale: float,
    run_time_s: int,
    total: int,
    scheduled_s: float,
    clock: StepClock,
) -> PolicyRun:
    """Empty the cache under ``name``, replay ``trace`` with Locust; raise DemoError on failure.

    Prints the requests the server has finished every 15 s while the replay runs (``total``
    is the trace's length, ``scheduled_s`` when its last request is due). On the stock server
    (``name`` ``stock``) the block counts come from vLLM's own counters: hit tokens over the
    block size, and the trace's full prompt blocks, which the plugin counts as its queries.
    """
    from arc_loadtest.run import run_replay

    session.prepare(name)
    before = session.counters()
    started = time.monotonic()

    def answered() -> int:
        return int(session.counters().requests_finished - before.requests_finished)

    try:
        with ProgressReporter(name, total, answered, scheduled_s=scheduled_s,
                              print_line=clock.step):  # fmt: skip
            replay = run_replay(
                session.base_url, trace, out_dir=out / name, run_time_s=run_time_s,
                block_tokens=BLOCK_TOKENS, time_scale=time_scale, model=session.model,
                tokenizer=tokenizer, api_key=session.api_key,
            )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"the {name} replay did not finish within {exc.timeout:.0f}s") from exc
    seconds = time.monotonic() - started
    after = session.counters()
    (out / name / "locust.log").write_text(replay.log)
    summary = replay.summary
    if replay.exit_code != 0 or summary is None:
        raise DemoError(
            f"the {name} replay failed (Locust exit status {replay.exit_code}); log "
            f"{out / name / 'locust.log'}, last lines:\n{replay.log[-2000:]}"
        )
    if summary["requests_unsent"] or summary["requests_failed"]:
        raise DemoError(
            f"the {name} replay did not answer the whole trace: {summary['requests_ok']} ok, "
            f"{summary['requests_failed']} failed, {summary['requests_unsent']} unsent "
            f"(raise the run time or lower the load); log {out / name / 'locust.log'}"
        )
    if not session.plugin:
        replayed = load_trace(trace, block_tokens=BLOCK_TOKENS)
        queried = sum(request.num_blocks for request in replayed)
        hits = (after.prefix_hit_tokens - before.prefix_hit_tokens) / BLOCK_TOKENS
        return PolicyRun(name, summary, block_queries=queried, block_hits=hits, seconds=seconds)
    if after.active_policy != name:
        raise DemoError(f"the engine reports policy {after.active_policy!r} after the {name} run")
    return PolicyRun(
        name,
        summary,
        block_queries=after.block_queries - before.block_queries,
        block_hits=after.block_hits - before.block_hits,
        seconds=seconds,
    )


class _BackgroundServer(VllmServer):
    """The vLLM server at a lower CPU priority (``nice``) than the demo and Locust.

    On 2 shared cores the engine's busy steps would otherwise delay the load generator's
    dispatcher and distort the latencies it measures; in a cluster they run on separate
    machines.
    """

    def command(self) -> list[str]:
        return ["nice", "-n", str(SERVER_NICE), *super().command()]


class _StockServer(_BackgroundServer):
    """The same server with no ``ARC_EVICTOR_*`` variable, so the plugin stays off: vLLM as
    shipped, even when the demo itself runs with one set."""

    def environment(self) -> dict[str, str]:
        return {name: value for name, value in super().environment().items()
                if not name.startswith(PLUGIN_ENV_PREFIX)}  # fmt: skip


def demo_server(
    model_dir: Path, capacity_blocks: int, policy_file: Path | None, policy: str, log_path: Path
) -> VllmServer:
    """The demo's server (not started): the plugin reads ``policy_file``, written here; with
    ``policy_file`` None the same server without the plugin (``policy`` must be ``stock``)."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # serves POST /reset_prefix_cache
    if policy_file is None:
        if policy != STOCK:
            raise ValueError(f"a server without the plugin runs {STOCK!r}, not {policy!r}")
    else:
        write_policy_file(policy_file, policy)
        env |= {CONFIG_ENV: str(policy_file.resolve()), POLL_MS_ENV: str(POLL_MS)}
    server_class = _StockServer if policy_file is None else _BackgroundServer
    return server_class(
        model_dir,
        block_size=BLOCK_TOKENS,
        num_gpu_blocks=capacity_blocks + 1,  # + vLLM's null block
        max_model_len=min(MAX_MODEL_LEN, capacity_blocks * BLOCK_TOKENS),
        served_model_name="arc-demo",
        env=env,
        log_path=log_path,
        model_in_engine_process=False,  # the CPU build's own layout: the demo reports its timing
    )


def dashboard_monitor(server: VllmServer, log_path: Path) -> PrometheusServer | None:
    """A Prometheus (not started) scraping ``server`` as the chart's PodMonitor scrapes an
    engine pod; None when ``make tools`` has not installed the binary."""
    if not PROMETHEUS_BINARY.is_file():
        return None
    target = EngineTarget(f"127.0.0.1:{server.port}", DEMO_NAMESPACE, DEMO_POD, DEMO_SERVINGPOLICY)
    job = pod_monitor_job(DEMO_NAMESPACE, "arc-serving-engine", [target], SCRAPE_INTERVAL_S)
    return PrometheusServer([job], evaluation_interval_s=SCRAPE_INTERVAL_S, log_path=log_path)


def pace_to_server(
    session: ServerSession,
    requests: Sequence[TraceRequest],
    settings: DemoSettings,
    clock: StepClock,
) -> tuple[Pace, list[Prediction]]:
    """Time the server, choose the replay's speed, and predict again at that speed.

    The pace follows the baseline's predicted hit rate (the lowest: the busiest run), so
    every policy replays the same schedule; ``--time-scale`` overrides the speed only.
    """
    mean_prompt = sum(r.input_length for r in requests) // len(requests)
    calibration = measure_cost(session.complete, max(mean_prompt, 2 * BLOCK_TOKENS))
    cost = calibration.cost_model()
    sequential = predict(requests, settings.policies, settings.capacity_blocks, cost=None)
    hit_rate = min(p.sequential for p in sequential)
    chosen = pace(requests, cost, hit_rate, time_scale=settings.time_scale)
    clock.step(
        f"server timed: {calibration.describe()}; replay at time scale {chosen.time_scale:.2f} "
        f"({chosen.duration_s:.0f} s, the server busy about {100 * chosen.utilization:.0f}% of "
        f"it at the baseline's predicted hit rate)"
    )
    scaled = [replace(r, timestamp_s=r.timestamp_s * chosen.time_scale) for r in requests]
    predictions = predict(scaled, settings.policies, settings.capacity_blocks, cost=cost)
    clock.step("simulator prediction at that pace:\n" + prediction_table(predictions))
    return chosen, predictions


def replay_on_stock(
    model_dir: Path,
    settings: DemoSettings,
    trace_path: Path,
    total: int,
    replay_pace: Pace,
    clock: StepClock,
    log_path: Path,
) -> PolicyRun:
    """Start the same server without the plugin, warm it up, empty its cache and replay the
    trace at the plugin's runs' pace: the ``stock`` row."""
    server = demo_server(model_dir, settings.capacity_blocks, None, STOCK, log_path)
    with server:
        clock.step(
            f"{STOCK}: the same vLLM server without the plugin up at {server.base_url} in "
            f"{server.startup_seconds:.0f}s (log {log_path})"
        )
        session = ServerSession(server.base_url, server.served_model_name, None, server.api_key)
        warm_long_prompts(session.complete)
        clock.step(f"{STOCK}: empty the cache, replay the trace with Locust at the same pace")
        return replay_policy(session, STOCK, trace_path, settings.out, tokenizer=model_dir,
                             time_scale=replay_pace.time_scale,
                             run_time_s=replay_pace.deadline_s(), total=total,
                             scheduled_s=replay_pace.duration_s, clock=clock)  # fmt: skip


# --------------------------------------------------------------------------- main
def run_demo(settings: DemoSettings) -> int:
    """The whole demo (see the module docstring); returns the exit status."""
    from arc_harness.tinymodel import build_tiny_llama
    from arc_harness.vllm_server import VllmServerError

    clock = StepClock()
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "docqa.jsonl"
    params = settings.trace
    write_generated(trace_path, docqa(params), "bailian", BLOCK_TOKENS)
    requests = load_trace(trace_path, block_tokens=BLOCK_TOKENS)
    duration = requests[-1].timestamp_s - requests[0].timestamp_s
    distinct = len({key for request in requests for key in request.keys})
    clock.step(
        f"trace {trace_path}: {len(requests)} doc-QA requests over {duration:.0f} s "
        f"({params.documents} documents of ~{params.document_tokens} tokens, Zipf "
        f"{params.zipf_exponent}, seed {params.seed}), {distinct} distinct blocks of "
        f"{BLOCK_TOKENS} tokens; cache {settings.capacity_blocks} blocks"
    )
    predictions = predict(requests, settings.policies, settings.capacity_blocks)
    clock.step("simulator prediction at the same capacity:\n" + prediction_table(predictions))
    if settings.simulate_only:
        return 0

    model_dir = build_tiny_llama(out / "model", **MODEL)
    clock.step(f"model {model_dir} ({MODEL}, random weights, local tokenizer)")
    log_path = out / "vllm.log"
    log_path.unlink(missing_ok=True)
    server = demo_server(
        model_dir, settings.capacity_blocks, out / "policy.json", settings.policies[0], log_path
    )
    policy_file = out / "policy.json"
    runs: list[PolicyRun] = []
    stock: PolicyRun | None = None
    snapshot_path = out / "dashboards.png"
    snapshot_path.unlink(missing_ok=True)
    marks: list[AnnotationEvent] = []
    try:
        with server, contextlib.ExitStack() as monitoring:
            clock.step(
                f"vLLM up at {server.base_url} in {server.startup_seconds:.0f}s (log {log_path})"
            )
            monitor = dashboard_monitor(server, out / "prometheus.log")
            if monitor is None:
                clock.step(f"no {PROMETHEUS_BINARY} (run `make tools`): no dashboards.png")
            else:
                monitoring.enter_context(monitor)
                clock.step(f"Prometheus at {monitor.base_url} scrapes the engine every "
                           f"{SCRAPE_INTERVAL_S:g} s")  # fmt: skip
            session = ServerSession(
                server.base_url, server.served_model_name, policy_file, server.api_key
            )
            warm_long_prompts(session.complete)
            if monitor is not None:
                monitor.wait_until(lambda: monitor.query("up == 1") != [], SWITCH_TIMEOUT_S,
                                   "Prometheus's first scrape of the engine")  # fmt: skip
            replay_pace, predictions = pace_to_server(session, requests, settings, clock)
            runs_started = time.time()
            for name in settings.policies:
                clock.step(f"{name}: switch, empty the cache, replay the trace with Locust")
                runs.append(
                    replay_policy(session, name, trace_path, out, tokenizer=model_dir,
                                  time_scale=replay_pace.time_scale,
                                  run_time_s=replay_pace.deadline_s(), total=len(requests),
                                  scheduled_s=replay_pace.duration_s, clock=clock)
                )  # fmt: skip
            if monitor is not None:
                marks = snapshot(monitor, load_dashboard("overview.json"), runs_started,
                                 time.time(), SCRAPE_INTERVAL_S, snapshot_path).marks  # fmt: skip
                clock.step(f"dashboard snapshot {snapshot_path}")
                problems = switch_mark_problems(session.switches, marks, SCRAPE_INTERVAL_S)
                if problems:
                    print(f"warning: {snapshot_path}'s switch marks: {'; '.join(problems)}")
        if settings.stock:
            log_path = out / "vllm-stock.log"
            log_path.unlink(missing_ok=True)
            stock = replay_on_stock(model_dir, settings, trace_path, len(requests), replay_pace,
                                    clock, log_path)  # fmt: skip
    except VllmServerError as exc:
        print(f"error: the vLLM server failed: {exc}", file=sys.stderr)
        return 1
    except (DemoError, PrometheusError) as exc:
        print(f"error: {exc}\nserver log: {log_path}", file=sys.stderr)
        return 1
    clock.step("done; measured on the real vLLM server, simulated hit rates alongside")
    print()
    print(comparison_table(runs, predictions, stock))
    print("\n".join(gain_lines(runs) + (stock_lines(stock, runs) if stock else [])))
    title = (
        f"doc-QA trace, {len(requests)} requests, cache {settings.capacity_blocks} blocks of "
        f"{BLOCK_TOKENS} tokens; vLLM CPU build, one server, policy switched live"
        + (f"; {STOCK}: the same server without the plugin" if stock else "")
    )
    plotted = ([stock] if stock else []) + runs
    png = plot_comparison(plotted, predictions, out / "demo.png", title)
    report = {
        "settings": {
            "policies": list(settings.policies),
            "stock": settings.stock,
            "capacity_blocks": settings.capacity_blocks,
            "trace": asdict(params),
            "time_scale": replay_pace.time_scale,
            "utilization": replay_pace.utilization,
            "cost_model": asdict(cost_of(predictions)),
            "model": MODEL,
            "scrape_interval_s": SCRAPE_INTERVAL_S,
        },
        "predictions": [asdict(p) for p in predictions],
        "runs": [
            {"policy": r.policy, "block_queries": r.block_queries, "block_hits": r.block_hits,
             "block_hit_rate": r.block_hit_rate, "seconds": r.seconds, "summary": r.summary}
            for r in runs
        ],
        "stock": None if stock is None else {
            "block_queries": stock.block_queries, "block_hits": stock.block_hits,
            "block_hit_rate": stock.block_hit_rate, "seconds": stock.seconds,
            "summary": stock.summary,
        },
        "gains": [asdict(g) for g in gains(runs)],
        # Epoch seconds: each live switch, and the policy-switch marks dashboards.png shows.
        "switches": [asdict(switch) for switch in session.switches],
        "annotation_marks": [asdict(mark) for mark in marks],
    }  # fmt: skip
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    clock.step(f"plot {png}, figures {out / 'demo.json'}")
    if snapshot_path.is_file():
        print(f"dashboard snapshot: {snapshot_path}")
    return 0


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so the servers a demo started are stopped with it
    (they run in process groups of their own, which a signal to the demo does not reach)."""

    def exit_on(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    stop_on_sigterm()
    return run_demo(settings)


if __name__ == "__main__":
    sys.exit(main())
