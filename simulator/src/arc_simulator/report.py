"""Reporters for simulation results: a text table, JSON rows, a hit-rate plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from arc_simulator.simulate import SimulationResult


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def label(result: SimulationResult) -> str:
    """The policy, and the router when a fleet ran it."""
    return result.policy if result.router is None else f"{result.router} {result.policy}"


def table(results: Sequence[SimulationResult]) -> str:
    """One row per (capacity, router, policy), aligned for a terminal.

    A fleet adds its replica count and the imbalance of requests and of prefill
    tokens (the busiest replica's share times the replica count; 1.00 is even).
    Every table ends with the offered load (in replicas), the busiest replica's
    utilisation over the span and its peak utilisation, over the busiest tenth of the
    span (``SimulationResult.utilisations``, ``peak_utilisations``; a peak of 1.00 or more
    is overload).
    """
    overlapping = any(result.ttft_p50_s is not None for result in results)
    fleet = any(result.router is not None for result in results)
    header = [
        "capacity",
        "policy",
        "requests",
        "block hit",
        "token hit",
        "evictions",
        "ghost hits",
        "final p",
    ]
    if fleet:
        header[1:1] = ["replicas", "router"]
        header += ["rejected", "req imbal", "prefill imbal"]
    if overlapping:
        header += ["TTFT p50 ms", "p90 ms", "p99 ms"]
    header += ["offered", "max util", "peak util"]
    text_columns = {header.index("policy")} | ({header.index("router")} if fleet else set())
    rows = [header]
    for result in results:
        row = [
            f"{result.capacity:,}",
            result.policy,
            f"{result.requests:,}",
            f"{result.block_hit_rate:.4f}",
            f"{result.token_hit_rate:.4f}",
            f"{result.evictions:,}",
            f"{sum(result.ghost_hits.values()):,}" if result.ghost_hits else "-",
            "-" if result.final_p is None else f"{result.final_p:.1f}",
        ]
        if fleet:
            row[1:1] = [str(result.replicas), result.router or "-"]
            row += [
                f"{result.rejected_requests:,}",
                f"{result.request_imbalance:.2f}",
                f"{result.prefill_imbalance:.2f}",
            ]
        if overlapping:
            row += [_ms(result.ttft_p50_s), _ms(result.ttft_p90_s), _ms(result.ttft_p99_s)]
        row += [
            _ratio(result.offered_load),
            _ratio(result.max_utilisation),
            _ratio(result.max_peak_utilisation),
        ]
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = []
    for number, row in enumerate(rows):
        cells = [
            cell.ljust(widths[i]) if i in text_columns else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def to_json(results: Sequence[SimulationResult]) -> str:
    """A JSON list with one object per result (``policy``, ``capacity``, rates, ...;
    ``replicas``, ``router`` and per-replica load shares for a fleet; ``utilisation``
    per replica, ``max_utilisation`` and ``offered_load``)."""
    return json.dumps([result.as_dict() for result in results], indent=2)


def plot(results: Sequence[SimulationResult], path: str | Path, title: str) -> Path:
    """Block hit rate against capacity, one line per policy (and router), written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(label(result) for result in results):
        points = sorted((r.capacity, r.block_hit_rate) for r in results if label(r) == name)
        style = {"linestyle": "--", "color": "grey"} if name == "belady" else {}
        axes.plot([c for c, _ in points], [h for _, h in points], marker="o", label=name, **style)
    fleet = any(result.router is not None for result in results)
    axes.set_xlabel("cache capacity per replica (blocks)" if fleet else "cache capacity (blocks)")
    axes.set_ylabel("block hit rate (prefix semantics)")
    axes.set_title(title)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
