"""The scaling study: how routers and eviction policies fare from 1 to 32 replicas.

For each trace (the public Mooncake sample ``arc_simulator.MOONCAKE_SAMPLE`` and
generated document-QA and conversation traces, fixed seed), each replica count,
each router (``arc_simulator.routing``) and each policy, the fleet simulation
(``arc_simulator.fleet``) runs at two cache sizes:

- ``per-replica``: every replica holds ``capacity`` percent of the trace's
  distinct blocks, so the fleet's total cache grows with the replica count (adding
  pods adds cache);
- ``total``: the fleet holds ``capacity`` percent in all, split evenly (the same
  memory cut into more pods).

One replica is simulated once per policy and shared by every router: with one
replica every router sends every request to it (the tests check this).

A ``--trace`` item is one of those names or a trace file (its name in the
outputs is the file's stem). ``--time-scale F`` multiplies every trace's
inter-arrival times by F (divides the request rate by F); the cost-model options
are ``arc-evictor simulate``'s and state the GPU.

Outputs in the output folder: ``scale.txt`` (one line per trace, cache size,
replica count and router, with each policy's block hit rate, the best policy
(``tie`` when all are equal), and the imbalance, offered load, busiest replica's
utilisation and peak utilisation and TTFT of the recommended policy's run),
``scale.csv`` and ``scale.json`` (one row per run), and ``scale-<trace>.png``
(hit rate and imbalance against replicas, one line per router).

Load (``SimulationResult.utilisations``): a replica's utilisation is the larger
of its prefill utilisation (its serial prefill lane's busy time, ``CostModel``'s
step plus uncached prompt tokens times the prefill time per token for each
request it served, over the trace's span) and its KV utilisation (the time
integral of its pool's pinned blocks over its blocks times the span; decode time
counts here, as a running request keeps its blocks pinned). The offered load is
the fleet's sum of either, in replicas, against a capacity of N replicas. Its
peak utilisation takes the prefill of the requests arriving in the busiest tenth
of the span instead of the whole span. A run is overloaded when a replica's peak
utilisation is 1 or more: it falls behind for a tenth of the run or longer, so
its queue grows. For each trace and replica count with an overloaded run, one
warning goes to stderr (``overload_warnings``) naming the offered load, the
capacity and how to scale.

    arc-evictor scale [--out out/scale] [--replicas 1,2,4,8,16,32]
                      [--cache per-replica,total] [--router ...] [--policy lru,arc,trio]
                      [--trace mooncake,docqa,conversation,FILE] [--capacity 10] [--sequential]
                      [--seed 0] [--router-temperature 0] [--session-affinity-ttl S]
                      [--time-scale 1]
                      [--prefill-tokens-per-second 20000] [--decode-seconds-per-token 0.02]
                      [--step-seconds 0.005] [--max-batch-tokens 1000000]
    python -m arc_simulator.scaling ...   (the same)

The defaults take about two and a half minutes of one core's time.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arc_evictor.policies.base import PolicyError
from arc_serving_common.traces import TraceError, TraceRequest, load_trace
from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.command import (
    Subcommands,
    UsageError,
    program_parser,
    run,
    writable_folder,
)
from arc_simulator.fleet import check_fleet, simulate_fleet
from arc_simulator.generate import (
    ConversationParams,
    DocQAParams,
    conversation,
    docqa,
    write_generated,
)
from arc_simulator.routing import (
    RoutingError,
    check_replicas,
    check_router,
    crowded_session,
    vllm_router_names,
)
from arc_simulator.simulate import (
    MAX_TIME_SCALE,
    CostModel,
    build_policy,
    check_time_scale,
    time_scaled,
)

TRACES = ("mooncake", "docqa", "conversation")
# The peak utilisation the warning's advice aims at: below 1, with room for bursts.
TARGET_UTILISATION = 0.8
CACHE_SIZES = ("per-replica", "total")
RECOMMENDED_POLICY = "trio"
# Smaller than the evaluation's traces, so that the default study stays short.
DOCQA = DocQAParams(documents=100, document_tokens=2_000, questions_per_document=4.0)
CONVERSATION = ConversationParams(sessions=100)


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """What to run; the defaults are ``arc-evictor scale``'s."""

    replicas: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    cache_sizes: tuple[str, ...] = CACHE_SIZES
    routers: tuple[str, ...] = tuple(vllm_router_names())
    policies: tuple[str, ...] = ("lru", "arc", RECOMMENDED_POLICY)
    traces: tuple[str, ...] = TRACES
    capacity_percent: float = 10.0
    sequential: bool = False
    seed: int = 0
    temperature: float = 0.0  # the router's --router-temperature (kv_aware only)
    # The router's --kv-aware-session-affinity-ttl-secs (kv_aware only; None: off).
    affinity_ttl_s: int | None = None
    time_scale: float = 1.0  # multiplies inter-arrival times (``simulate.time_scaled``)
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        for label, values in (
            ("replicas", self.replicas),
            ("cache sizes", self.cache_sizes),
            ("routers", self.routers),
            ("policies", self.policies),
            ("traces", self.traces),
        ):
            if not values:
                raise ValueError(f"the study needs at least one of its {label}")
        for count in self.replicas:
            check_replicas(count)
        for name in self.routers:
            check_router(name, 1, self.temperature, self.affinity_ttl_s)
        for name in self.policies:
            build_policy(name, 1, [])
            check_fleet(name, max(self.replicas))
        for size in self.cache_sizes:
            if size not in CACHE_SIZES:
                raise ValueError(f"unknown cache size {size!r}; valid: {', '.join(CACHE_SIZES)}")
        for trace in self.traces:
            if trace not in TRACES and not Path(trace).is_file():
                raise ValueError(
                    f"unknown trace {trace!r}; valid: {', '.join(TRACES)} or a trace file"
                )
        labels = [trace_label(trace) for trace in self.traces]
        if len(set(labels)) < len(labels):
            raise ValueError(f"--trace {','.join(self.traces)}: two traces named alike")
        if not 0 < self.capacity_percent <= 100:
            raise ValueError(f"capacity must be a percent in (0, 100], got {self.capacity_percent}")
        check_time_scale(self.time_scale)


def trace_label(trace: str) -> str:
    """A study trace's name in the outputs: the name, or a trace file's stem."""
    return trace if trace in TRACES else Path(trace).stem


def load_study_trace(name: str, folder: Path) -> list[TraceRequest]:
    """The Mooncake sample, a generated trace written to ``folder`` first, or a trace file."""
    if name == "mooncake":
        return load_trace(MOONCAKE_SAMPLE)
    if name not in TRACES:
        return load_trace(name)
    path = folder / f"{name}.jsonl"
    generated = docqa(DOCQA) if name == "docqa" else conversation(CONVERSATION)
    write_generated(path, generated, "bailian")
    return load_trace(path)


def per_replica_capacity(distinct: int, percent: float, cache_size: str, replicas: int) -> int:
    total = distinct * percent / 100
    return max(1, round(total if cache_size == "per-replica" else total / replicas))


def run_study(
    config: ScaleConfig, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """Every run of the study, one row each."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        traces = {
            trace_label(name): time_scaled(load_study_trace(name, Path(folder)), config.time_scale)
            for name in config.traces
        }
    for trace, requests in traces.items():
        distinct = len({key for request in requests for key in request.keys})
        if progress:
            progress(f"{trace}: {len(requests):,} requests, {distinct:,} distinct blocks")
        crowded = crowded_session(requests, trace, config.routers, config.affinity_ttl_s)
        if crowded is not None:
            print(f"arc-evictor: warning: {crowded}", file=sys.stderr)
        for cache_size in config.cache_sizes:
            for replicas in config.replicas:
                capacity = per_replica_capacity(
                    distinct, config.capacity_percent, cache_size, replicas
                )
                # One replica: every router sends everything to it, so run it once.
                routers = config.routers[:1] if replicas == 1 else config.routers
                for router in routers:
                    for policy in config.policies:
                        result, _ = simulate_fleet(
                            requests,
                            policy,
                            capacity,
                            replicas,
                            router,
                            sequential=config.sequential,
                            cost=config.cost,
                            seed=config.seed,
                            temperature=config.temperature,
                            affinity_ttl_s=config.affinity_ttl_s,
                        )
                        row = result.as_dict()
                        row.update(
                            trace=trace,
                            cache=cache_size,
                            policy=policy,
                            time_scale=config.time_scale,
                            temperature=config.temperature,
                            affinity_ttl_s=config.affinity_ttl_s,
                        )
                        shared = config.routers if replicas == 1 else (router,)
                        rows.extend({**row, "router": name} for name in shared)
    return rows


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["trace"], row["cache"], row["replicas"], row["router"]


def table(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    """One line per trace, cache size, replica count and router."""
    shown = RECOMMENDED_POLICY if RECOMMENDED_POLICY in policies else policies[0]
    groups: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_key(row), {})[row["policy"]] = row
    header = [
        "trace",
        "cache",
        "replicas",
        "blocks/replica",
        "router",
        *(f"{name} hit" for name in policies),
        "best",
        f"req imbal ({shown})",
        "prefill imbal",
        "rejected",
        "offered",
        "max util",
        "peak util",
        "TTFT p90 ms",
    ]
    lines = [header]
    for (trace, cache, replicas, router), by_policy in groups.items():
        main = by_policy[shown]
        rates = {name: by_policy[name]["block_hit_rate"] for name in policies}
        best = max(rates, key=rates.__getitem__)
        if len(set(rates.values())) == 1 and len(rates) > 1:
            best = "tie"
        p90 = main["ttft_p90_s"]
        lines.append(
            [
                trace,
                cache,
                str(replicas),
                f"{main['capacity']:,}",
                router,
                *(f"{by_policy[name]['block_hit_rate']:.4f}" for name in policies),
                best,
                f"{main['request_imbalance']:.2f}",
                f"{main['prefill_imbalance']:.2f}",
                f"{main['rejected_requests']:,}",
                _number(main["offered_load"]),
                _number(main["max_utilisation"]),
                _number(main["max_peak_utilisation"]),
                "-" if p90 is None else f"{p90 * 1000:.0f}",
            ]
        )
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    text = {0, 1, 4}
    out = []
    for number, line in enumerate(lines):
        cells = [
            c.ljust(widths[i]) if i in text else c.rjust(widths[i]) for i, c in enumerate(line)
        ]
        out.append("  ".join(cells).rstrip())
        if number == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


CSV_FIELDS = (
    "trace",
    "cache",
    "replicas",
    "capacity",
    "router",
    "policy",
    "mode",
    "requests",
    "rejected_requests",
    "block_hit_rate",
    "token_hit_rate",
    "request_imbalance",
    "prefill_imbalance",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "time_scale",
    "temperature",
    "affinity_ttl_s",
    "offered_load",
    "max_utilisation",
    "max_peak_utilisation",
    "overloaded",
)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _run_name(row: dict[str, Any]) -> str:
    parts = [row["router"] if row["replicas"] > 1 else None, row.get("policy")]
    parts.append(f"{row['cache']} cache" if "cache" in row else f"{row['capacity']:,} blocks")
    return ", ".join(str(part) for part in parts if part)


def _distinct_runs(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the copies ``run_study`` makes of a one-replica run per router."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        router = row.get("router") if row["replicas"] > 1 else None
        seen.setdefault((row.get("cache"), row["capacity"], row.get("policy"), router), row)
    return list(seen.values())


def overload_warnings(
    rows: Sequence[dict[str, Any]], time_scale: float = 1.0, cost: CostModel | None = None
) -> list[str]:
    """One warning per trace and replica count with an overloaded run, in row order.

    ``rows`` are ``SimulationResult.as_dict`` rows with ``trace`` added. A run is
    overloaded when a replica's peak utilisation is 1 or more
    (``SimulationResult.overloaded``). The warning names the trace, the replica count,
    the runs' offered load over the span (replicas' worth of the resource that binds
    on the worst run's busiest replica, prefill or KV cache), the capacity (N
    replicas), that replica's peak utilisation, and how to scale: a time scale, a GPU
    or cache, or a replica count that would bring the peak to ``TARGET_UTILISATION``,
    assuming utilisation falls in proportion (hits move a little with the load).
    """
    cost = cost or CostModel()
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["trace"], row["replicas"]), []).append(row)
    warnings = []
    for (trace, replicas), all_runs in groups.items():
        group = _distinct_runs(all_runs)
        over = [row for row in group if row["overloaded"]]
        if not over:
            continue
        worst = max(over, key=lambda row: row["max_peak_utilisation"])
        peak = worst["max_peak_utilisation"]
        replica = worst["peak_utilisation"].index(peak)
        prefill_binds = worst["kv_utilisation"][replica] < peak
        loads = [row["offered_prefill" if prefill_binds else "offered_kv"] for row in group]
        low, high = f"{min(loads):.2f}", f"{max(loads):.2f}"
        offered = low if low == high else f"{low}-{high}"
        if prefill_binds:
            what = "prefill (prefill seconds per second of trace time)"
            how = (
                "the prefill arriving at the busiest replica in the busiest tenth of the "
                f"trace needs {peak:.2f} times that tenth"
            )
        else:
            what = "KV cache (pinned block-seconds per second of trace time, over one pool)"
            how = f"the busiest replica's pinned blocks fill its pool {peak:.2f} times over"
        room = (
            "; on average the fleet has room, but not that replica in that stretch"
            if max(loads) < replicas
            else ""
        )
        factor = peak / TARGET_UTILISATION
        slower = time_scale * factor
        options = [
            f"--time-scale {_round_up(slower, 2):g} or more"
            if slower <= MAX_TIME_SCALE
            else "a slower trace"
        ]
        if prefill_binds and cost.prefill_seconds_per_token > 0:
            rate = _round_up(factor / cost.prefill_seconds_per_token, 2)
            options.append(f"a faster GPU (--prefill-tokens-per-second {rate:,.0f} or more)")
        elif not prefill_binds:
            options.append(f"a cache {_round_up(factor, 2):g} times larger (--capacity)")
        options.append(f"{max(replicas + 1, math.ceil(replicas * factor))} or more replicas")
        advice = ", ".join(options[:-1]) + ", or " + options[-1]
        effect = (
            "its queue grows: TTFT is mostly queueing and the hit rates are those of an "
            "overloaded fleet"
            if worst.get("mode") == "overlapping"
            else "a real fleet's queue would grow (sequential mode does not queue)"
        )
        runs = f" ({len(over)} of {len(group)} runs)" if len(group) > 1 else ""
        plural = "s" * (replicas > 1)
        warnings.append(
            f"arc-evictor: warning: {trace} on {replicas} replica{plural} is overloaded{runs}: "
            f"it offers {offered} replicas' worth of {what} against a capacity of {replicas}, "
            f"and {how} ({_run_name(worst)}){room}, so {effect}. To serve it (peak near "
            f"{TARGET_UTILISATION}): {advice}."
        )
    return warnings


def _round_up(value: float, significant: int) -> float:
    """``value`` rounded up to ``significant`` significant digits (1.4375 -> 1.5)."""
    if value <= 0:
        return value
    step = 10.0 ** (math.floor(math.log10(value)) - significant + 1)
    return round(math.ceil(value / step - 1e-9) * step, 12)


def plot(rows: Sequence[dict[str, Any]], trace: str, policy: str, path: Path) -> Path:
    """Hit rate and prefill imbalance against replicas, one line per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [row for row in rows if row["trace"] == trace and row["policy"] == policy]
    caches = list(dict.fromkeys(row["cache"] for row in mine))
    figure, axes = plt.subplots(2, len(caches), figsize=(6 * len(caches), 7), squeeze=False)
    for column, cache in enumerate(caches):
        for router in dict.fromkeys(row["router"] for row in mine):
            points = sorted(
                (row["replicas"], row["block_hit_rate"], row["prefill_imbalance"])
                for row in mine
                if row["cache"] == cache and row["router"] == router
            )
            counts = [count for count, _, _ in points]
            axes[0][column].plot(counts, [hit for _, hit, _ in points], marker="o", label=router)
            axes[1][column].plot(counts, [imb for _, _, imb in points], marker="o", label=router)
        axes[0][column].set_title(f"{trace}, {cache} cache, {policy}")
        axes[0][column].set_ylabel("block hit rate (all replicas)")
        axes[1][column].set_ylabel("prefill imbalance (max share x N)")
        for row_axes in (axes[0][column], axes[1][column]):
            row_axes.set_xscale("log", base=2)
            row_axes.set_xlabel("replicas")
            row_axes.grid(alpha=0.3)
        axes[0][column].set_ylim(bottom=0)
        axes[0][column].legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """``--time-scale`` and the cost model's options (``CostModel``), shared by ``simulate``."""
    defaults = CostModel()
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply the trace's inter-arrival times (2 halves the request rate; "
        f"in (0, {MAX_TIME_SCALE:g}], default %(default)s)",
    )
    cost = parser.add_argument_group("cost model (the GPU; see CostModel)")
    cost.add_argument(
        "--prefill-tokens-per-second",
        type=float,
        default=1.0 / defaults.prefill_seconds_per_token,
        help="uncached prompt tokens one replica prefills per second, serially "
        "(default %(default)s)",
    )
    cost.add_argument(
        "--decode-seconds-per-token",
        type=float,
        default=defaults.decode_seconds_per_token,
        help="per output token, per request, alongside everything else (default %(default)s)",
    )
    cost.add_argument(
        "--step-seconds",
        type=float,
        default=defaults.step_seconds,
        help="fixed overhead per prefill (default %(default)s)",
    )
    cost.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="prompt plus output tokens of a replica's running requests (default %(default)s)",
    )


def cost_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model of ``add_load_arguments``'s options; UsageError names a bad one."""
    rate = args.prefill_tokens_per_second
    if not (math.isfinite(rate) and rate > 0 and math.isfinite(1.0 / rate)):
        raise UsageError(f"--prefill-tokens-per-second must be a finite number > 0, got {rate}")
    for option, value in (
        ("--decode-seconds-per-token", args.decode_seconds_per_token),
        ("--step-seconds", args.step_seconds),
    ):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{option} must be a finite number >= 0, got {value}")
    if args.max_batch_tokens < 1:
        raise UsageError(
            f"--max-batch-tokens must be a whole number >= 1, got {args.max_batch_tokens}"
        )
    return CostModel(
        prefill_seconds_per_token=1.0 / rate,
        decode_seconds_per_token=args.decode_seconds_per_token,
        step_seconds=args.step_seconds,
        max_batch_tokens=args.max_batch_tokens,
    )


def time_scale_from_args(args: argparse.Namespace) -> float:
    """``--time-scale``, checked; UsageError names it."""
    try:
        check_time_scale(args.time_scale)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return float(args.time_scale)


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ScaleConfig()
    parser.add_argument(
        "--out", type=Path, default=Path("out/scale"), help="output folder (default: %(default)s)"
    )
    parser.add_argument(
        "--replicas",
        default=",".join(map(str, defaults.replicas)),
        help="replica counts, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--cache",
        default=",".join(defaults.cache_sizes),
        help="per-replica: every replica holds --capacity; total: the fleet holds --capacity,"
        " split evenly (default: %(default)s)",
    )
    parser.add_argument(
        "--router",
        default=",".join(defaults.routers),
        help="routers, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--policy",
        default=",".join(defaults.policies),
        help="eviction policies, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--trace",
        default=",".join(defaults.traces),
        help=f"traces, from: {', '.join(TRACES)}, or trace files (default: %(default)s)",
    )
    parser.add_argument(
        "--capacity",
        type=float,
        default=defaults.capacity_percent,
        help="cache size, percent of the trace's distinct blocks (default: %(default)s)",
    )
    parser.add_argument("--sequential", action="store_true", help="sequential mode")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of random and of kv_aware's temperature draws"
    )
    parser.add_argument(
        "--router-temperature",
        type=float,
        default=defaults.temperature,
        help="kv_aware: 0 takes the least cost, above 0 draws with weights "
        "exp(-(cost - least) / T), as vllm-router's flag (default: %(default)s)",
    )
    parser.add_argument(
        "--session-affinity-ttl",
        type=int,
        metavar="SECONDS",
        help="kv_aware: keep each session on the replica of its last request while it pauses "
        "no longer than this, as vllm-router's --kv-aware-session-affinity-ttl-secs "
        "(default: off)",
    )
    add_load_arguments(parser)


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(item.strip().lower() for item in text.split(",")))


def _traces(text: str) -> tuple[str, ...]:
    """Trace names (any case) or file paths (as written)."""
    items = (item.strip() for item in text.split(","))
    return tuple(dict.fromkeys(item.lower() if item.lower() in TRACES else item for item in items))


def config_from_args(args: argparse.Namespace) -> ScaleConfig:
    """The study's configuration, every value checked; ValueError names a bad one."""
    try:
        replicas = tuple(sorted({int(item) for item in args.replicas.split(",")}))
    except ValueError:
        raise ValueError(
            f"--replicas {args.replicas!r} must be comma-separated whole numbers"
        ) from None
    return ScaleConfig(
        replicas=replicas,
        cache_sizes=_names(args.cache),
        routers=_names(args.router),
        policies=_names(args.policy),
        traces=_traces(args.trace),
        capacity_percent=args.capacity,
        sequential=args.sequential,
        seed=args.seed,
        temperature=args.router_temperature,
        affinity_ttl_s=args.session_affinity_ttl,
        time_scale=time_scale_from_args(args),
        cost=cost_from_args(args),
    )


def run_scale(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> int:
    """Check the arguments, run the study, write its outputs and print the table."""
    config = config_from_args(args)
    rows = run_study(config, progress)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows, config.policies)
    (out / "scale.txt").write_text(text + "\n", encoding="utf-8")
    (out / "scale.csv").write_text(to_csv(rows), encoding="utf-8")
    (out / "scale.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    shown = RECOMMENDED_POLICY if RECOMMENDED_POLICY in config.policies else config.policies[0]
    for trace in map(trace_label, config.traces):
        plot(rows, trace, shown, out / f"scale-{trace}.png")
    print(text)
    mode = "sequential" if config.sequential else "overlapping"
    print(f"\n{mode} mode; results, plots and CSV/JSON in {out}")
    for warning in overload_warnings(rows, config.time_scale, config.cost):
        print(warning, file=sys.stderr)
    return 0


def scale_command(args: argparse.Namespace) -> int:
    """``arc-evictor scale``: a bad argument is a UsageError, raised before any work."""
    if not writable_folder(args.out / "scale.txt"):
        raise UsageError(f"--out {args.out}: not a folder this user can write into")
    try:
        return run_scale(args, lambda line: print(line, file=sys.stderr))
    except ValueError as error:
        if isinstance(error, PolicyError | TraceError | RoutingError):
            raise
        raise UsageError(str(error)) from None


def add_scale_command(commands: Subcommands) -> None:
    """Add ``scale`` to an ``arc-evictor`` parser's subparsers (``command.program_parser``)."""
    scale = commands.add_parser(
        "scale", help="the scaling study: routers and policies over 1 to 32 replicas"
    )
    add_scale_arguments(scale)
    scale.set_defaults(run=scale_command)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m arc_simulator.scaling ARGS``: the same as ``arc-evictor scale ARGS``."""
    parser, commands = program_parser()
    add_scale_command(commands)
    return run(parser.parse_args(["scale", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
