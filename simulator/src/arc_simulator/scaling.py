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

Outputs in the output folder: ``scale.txt`` (one line per trace, cache size,
replica count and router, with each policy's block hit rate, the best policy
(``tie`` when all are equal),
and the imbalance and TTFT of the recommended policy's run), ``scale.csv`` and
``scale.json`` (one row per run), and ``scale-<trace>.png`` (hit rate and
imbalance against replicas, one line per router).

    arc-evictor scale [--out out/scale] [--replicas 1,2,4,8,16,32]
                      [--cache per-replica,total] [--router ...] [--policy lru,arc,trio]
                      [--trace mooncake,docqa,conversation] [--capacity 10] [--sequential]
                      [--seed 0] [--router-temperature 0]
    python -m arc_simulator.scaling ...   (the same)

The defaults take about two and a half minutes of one core's time.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from arc_simulator.routing import RoutingError, check_replicas, make_router, router_names
from arc_simulator.simulate import build_policy

TRACES = ("mooncake", "docqa", "conversation")
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
    routers: tuple[str, ...] = tuple(router_names())
    policies: tuple[str, ...] = ("lru", "arc", RECOMMENDED_POLICY)
    traces: tuple[str, ...] = TRACES
    capacity_percent: float = 10.0
    sequential: bool = False
    seed: int = 0
    temperature: float = 0.0  # the router's --router-temperature (kv_aware only)

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
            make_router(name, 1, self.seed, self.temperature)
        for name in self.policies:
            build_policy(name, 1, [])
            check_fleet(name, max(self.replicas))
        for size in self.cache_sizes:
            if size not in CACHE_SIZES:
                raise ValueError(f"unknown cache size {size!r}; valid: {', '.join(CACHE_SIZES)}")
        for trace in self.traces:
            if trace not in TRACES:
                raise ValueError(f"unknown trace {trace!r}; valid: {', '.join(TRACES)}")
        if not 0 < self.capacity_percent <= 100:
            raise ValueError(f"capacity must be a percent in (0, 100], got {self.capacity_percent}")


def load_study_trace(name: str, folder: Path) -> list[TraceRequest]:
    """The Mooncake sample, or a generated trace written to ``folder`` first."""
    if name == "mooncake":
        return load_trace(MOONCAKE_SAMPLE)
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
        traces = {name: load_study_trace(name, Path(folder)) for name in config.traces}
    for trace, requests in traces.items():
        distinct = len({key for request in requests for key in request.keys})
        if progress:
            progress(f"{trace}: {len(requests):,} requests, {distinct:,} distinct blocks")
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
                            seed=config.seed,
                            temperature=config.temperature,
                        )
                        row = result.as_dict()
                        row.update(trace=trace, cache=cache_size, policy=policy)
                        shared = config.routers if replicas == 1 else (router,)
                        rows.extend({**row, "router": name} for name in shared)
    return rows


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
)


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


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
        help=f"traces, from: {', '.join(TRACES)} (default: %(default)s)",
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


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(item.strip().lower() for item in text.split(",")))


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
        traces=_names(args.trace),
        capacity_percent=args.capacity,
        sequential=args.sequential,
        seed=args.seed,
        temperature=args.router_temperature,
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
    for trace in config.traces:
        plot(rows, trace, shown, out / f"scale-{trace}.png")
    print(text)
    mode = "sequential" if config.sequential else "overlapping"
    print(f"\n{mode} mode; results, plots and CSV/JSON in {out}")
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
