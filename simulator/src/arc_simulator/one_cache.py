"""What share of one big cache a fleet keeps, and how evenly it loads its replicas.

For each trace and replica count N, each router setting runs the fleet model (overlapping
mode, the trace at its own rate) with the fleet's cache fixed at ``--capacity`` percent of the
trace's distinct blocks, split evenly over the N replicas; the same requests also run on one
replica holding the whole of it. A row gives the fleet's block hit rate as a share of that one
replica's (``kept``) and the request imbalance (the busiest replica's share of the requests
times N: 1.00 is even). A setting that draws at random (``kv_aware`` above temperature 0) runs
``--seeds`` seeds and reports their mean and their range of ``kept``. The target this study
judges by: ``kept`` at least ``TARGET_KEPT`` with imbalance at most ``TARGET_IMBALANCE``.

    python -m arc_simulator.one_cache [--trace docqa,FILE] [--replicas 2,4,8]
                                      [--policy trio] [--capacity 10] [--seeds 5]
                                      [--json FILE]

A trace is ``arc_simulator.scaling``'s ``docqa``, ``conversation`` or ``mooncake``, or a trace
file. The settings are vllm-router's (``round_robin``, ``consistent_hash``, ``cache_aware`` at
its defaults, ``kv_aware`` at temperature 0 and 1, and at 1 with a 60 s session affinity) and
the proposal ``bounded_prefix`` (``arc_simulator.routing``) at several load bounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from arc_simulator.fleet import simulate_fleet
from arc_simulator.routing import DEFAULT_LOAD_BOUND
from arc_simulator.scaling import load_study_trace, per_replica_capacity, trace_label
from arc_simulator.simulate import simulate

TARGET_KEPT = 0.95
TARGET_IMBALANCE = 1.25


@dataclass(frozen=True, slots=True)
class Setting:
    """One router with its arguments; ``draws`` when its decisions depend on the seed."""

    label: str
    router: str
    temperature: float = 0.0
    affinity_ttl_s: int | None = None
    load_bound: float = DEFAULT_LOAD_BOUND

    @property
    def draws(self) -> bool:
        return self.router == "kv_aware" and self.temperature > 0


SETTINGS = (
    Setting("round_robin", "round_robin"),
    Setting("consistent_hash", "consistent_hash"),
    Setting("cache_aware", "cache_aware"),
    Setting("kv_aware T=0", "kv_aware"),
    Setting("kv_aware T=1", "kv_aware", temperature=1.0),
    Setting("kv_aware T=1, affinity 60 s", "kv_aware", temperature=1.0, affinity_ttl_s=60),
    *(
        Setting(f"bounded_prefix e={bound:g}", "bounded_prefix", load_bound=bound)
        for bound in (0.1, 0.25)
    ),
)


@dataclass(slots=True)
class Row:
    """One trace, replica count and setting: ``kept`` and ``imbalance`` are means over the
    seeds run; ``kept_low``/``kept_high`` their least and greatest."""

    trace: str
    replicas: int
    setting: str
    policy: str
    capacity_per_replica: int
    one_cache_hit_rate: float
    hit_rate: float
    kept: float
    kept_low: float
    kept_high: float
    imbalance: float
    seeds: int
    peak_utilisation: float | None = None

    @property
    def meets_target(self) -> bool:
        return self.kept >= TARGET_KEPT and self.imbalance <= TARGET_IMBALANCE


def study(
    traces: Sequence[str],
    replicas: Sequence[int],
    policy: str = "trio",
    capacity_percent: float = 10.0,
    seeds: int = 5,
    settings: Sequence[Setting] = SETTINGS,
) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        loaded = {trace_label(name): load_study_trace(name, Path(folder)) for name in traces}
    for trace, requests in loaded.items():
        distinct = len({key for request in requests for key in request.keys})
        total = per_replica_capacity(distinct, capacity_percent, "total", 1)
        one = simulate(requests, policy, total, sequential=False).block_hit_rate
        for count in replicas:
            capacity = per_replica_capacity(distinct, capacity_percent, "total", count)
            for setting in settings:
                results = [
                    simulate_fleet(
                        requests, policy, capacity, count, setting.router, sequential=False,
                        seed=seed, temperature=setting.temperature,
                        affinity_ttl_s=setting.affinity_ttl_s, load_bound=setting.load_bound,
                    )[0]
                    for seed in range(seeds if setting.draws else 1)
                ]  # fmt: skip
                kept = [result.block_hit_rate / one for result in results]
                peaks = [result.max_peak_utilisation for result in results]
                rows.append(
                    Row(
                        trace, count, setting.label, policy, capacity, one,
                        statistics.fmean(result.block_hit_rate for result in results),
                        statistics.fmean(kept), min(kept), max(kept),
                        statistics.fmean(result.request_imbalance for result in results),
                        len(results),
                        max((peak for peak in peaks if peak is not None), default=None),
                    )
                )  # fmt: skip
    return rows


def table(rows: Sequence[Row]) -> str:
    """Markdown: per trace, one line per setting, kept (imbalance) per replica count; a
    cell meeting the target is bold."""
    lines = []
    for trace in dict.fromkeys(row.trace for row in rows):
        of_trace = [row for row in rows if row.trace == trace]
        counts = sorted({row.replicas for row in of_trace})
        lines += [
            f"{trace}: one cache {of_trace[0].one_cache_hit_rate:.4f} ({of_trace[0].policy})",
            "",
            "| router | " + " | ".join(f"N = {count}" for count in counts) + " |",
            "|---|" + "---:|" * len(counts),
        ]
        for setting in dict.fromkeys(row.setting for row in of_trace):
            cells = []
            for count in counts:
                (row,) = [r for r in of_trace if r.setting == setting and r.replicas == count]
                text = f"{100 * row.kept:.0f}% ({row.imbalance:.2f})"
                if row.seeds > 1:
                    text += f" [{100 * row.kept_low:.0f}-{100 * row.kept_high:.0f}%]"
                cells.append(f"**{text}**" if row.meets_target else text)
            lines.append(f"| {setting} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m arc_simulator.one_cache", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--trace", default="docqa,conversation")
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--policy", default="trio")
    parser.add_argument("--capacity", type=float, default=10.0, help="percent, the fleet's total")
    parser.add_argument("--seeds", type=int, default=5, help="for settings that draw")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    try:
        replicas = [int(count) for count in args.replicas.split(",")]
    except ValueError:
        parser.error(f"--replicas needs whole numbers, got {args.replicas!r}")
    if args.seeds < 1 or not 0 < args.capacity <= 100 or min(replicas) < 2:
        parser.error("--seeds must be >= 1, --capacity in (0, 100], --replicas >= 2")
    rows = study(args.trace.split(","), replicas, args.policy, args.capacity, args.seeds)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
