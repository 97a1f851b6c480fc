"""A picture of a Grafana dashboard for readers without Grafana: every panel of the dashboard
drawn with matplotlib from a real Prometheus's range queries, with the panel's title, unit and
legend format, and the dashboard's policy-switch annotations as dashed vertical lines (a region
of merged marks shaded).

Queries are sent as Grafana would send them (``arc_harness.prometheus.expand``: every variable at
"All", ``$__interval`` and ``$__rate_interval`` by Grafana's rules for the time range), and an
annotation query's answer becomes events as Grafana's Prometheus data source makes them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from arc_harness.prometheus import Intervals, PrometheusServer, expand

ALL_ENGINES = {"namespace": None, "servingpolicy": None, "pod": None}
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
UNIT_LABELS = {"percentunit": "%", "s": "seconds", "ops": "per second", "short": ""}
COLUMNS = 2


@dataclass(frozen=True, slots=True)
class Line:
    """One series of one panel: its legend text and (time, value) points."""

    legend: str
    times: list[float]
    values: list[float]


@dataclass(frozen=True, slots=True)
class PanelData:
    title: str
    kind: str  # Grafana's panel type: timeseries or state-timeline
    unit: str
    lines: list[Line]


def legend_text(legend_format: str, labels: dict[str, str]) -> str:
    """Grafana's legend: ``{{label}}`` replaced by the series' label value."""
    return LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), legend_format).strip()


def fetch_panels(
    prometheus: PrometheusServer,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    scrape_interval_s: float,
) -> list[PanelData]:
    """Each non-row panel's series over [start, end], as Grafana would query them."""
    intervals = Intervals.for_range(end - start, scrape_interval_s)
    aligned = intervals.align(start, end)
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        lines = []
        for target in panel.get("targets", []):
            expr = expand(target["expr"], intervals, ALL_ENGINES)
            for series in prometheus.query_range(expr, *aligned, intervals.interval_s):
                points = [(float(t), float(v)) for t, v in series["values"]]
                lines.append(
                    Line(
                        legend_text(target.get("legendFormat", ""), series["metric"]),
                        [t for t, _ in points],
                        [v for _, v in points],
                    )
                )
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        panels.append(PanelData(panel["title"], panel["type"], unit, lines))
    return panels


@dataclass(frozen=True, slots=True)
class AnnotationEvent:
    """One annotation as Grafana shows it: a line at ``time``, or a region up to ``time_end``.

    ``step_s`` is the step of the query that found it: a policy-switch mark is at most one
    step after the first scrape that saw the switch.
    """

    time: float
    time_end: float
    step_s: float


@dataclass(frozen=True, slots=True)
class Switch:
    """A live policy switch to ``policy``: the policy file was written at ``written``, and
    /metrics first reported the new policy at ``reported``; it took effect in between."""

    policy: str
    written: float
    reported: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a drawn dashboard showed: each panel's data and the annotation events."""

    panels: list[PanelData]
    marks: list[AnnotationEvent]


def merged_events(times: list[float], step_s: float) -> list[AnnotationEvent]:
    """The events Grafana's Prometheus data source makes of one series' steps with a value
    > 0 (processEvents): marks no more than one step apart merge into one region."""
    events: list[AnnotationEvent] = []
    for at in sorted(times):
        if events and events[-1].time_end + step_s >= at:
            events[-1] = AnnotationEvent(events[-1].time, at, step_s)
        else:
            events.append(AnnotationEvent(at, at, step_s))
    return events


def annotation_events(
    prometheus: PrometheusServer,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    scrape_interval_s: float,
) -> list[AnnotationEvent]:
    """The events the dashboard's Prometheus annotations show within [start, end], by time."""
    events = []
    for annotation in dashboard["annotations"]["list"]:
        if "expr" not in annotation:
            continue
        step_s = duration_seconds(annotation.get("step", "0s"))
        intervals = Intervals.for_range(end - start, scrape_interval_s, step_s)
        expr = expand(annotation["expr"], intervals, ALL_ENGINES)
        # Up to one step after the end, so a mark for the last step is not cut off.
        for series in prometheus.query_range(
            expr, *intervals.align(start, end + step_s), intervals.interval_s
        ):
            marked = [float(t) for t, v in series["values"] if float(v) > 0]
            events += merged_events(marked, intervals.interval_s)
    return sorted(events, key=lambda event: event.time)


def switch_mark_problems(
    switches: Sequence[Switch], marks: Sequence[AnnotationEvent], scrape_interval_s: float
) -> list[str]:
    """What is wrong with the policy-switch marks, empty when each switch has exactly one
    event starting between the policy file's write and one scrape interval plus one query
    step after /metrics reported the switch, and no event starts anywhere else."""

    def after(switch: Switch, mark: AnnotationEvent) -> bool:
        return switch.written <= mark.time <= switch.reported + scrape_interval_s + mark.step_s

    problems = []
    for switch in switches:
        found = [mark.time for mark in marks if after(switch, mark)]
        if len(found) != 1:
            problems.append(
                f"the switch to {switch.policy} (written {switch.written:.1f}, reported "
                f"{switch.reported:.1f}) has {len(found)} marks within one scrape and one step "
                f"after it: {found}"
            )
    stray = [mark.time for mark in marks if not any(after(s, mark) for s in switches)]
    if stray:
        problems.append(f"marks with no switch before them: {stray}")
    return problems


def duration_seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m|h)", text)
    if not match:
        raise ValueError(f"not a duration: {text!r}")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


def draw(
    panels: list[PanelData],
    marks: list[AnnotationEvent],
    start: float,
    end: float,
    title: str,
    path: Path,
) -> Path:
    """The panels in a grid of two columns, dashboard order, time in minutes from ``start``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / COLUMNS)
    figure, grid = plt.subplots(rows, COLUMNS, figsize=(14, 3.1 * rows), squeeze=False)
    policies = sorted({line.legend.rsplit(": ", 1)[-1] for panel in panels
                       if panel.kind == "state-timeline" for line in panel.lines})  # fmt: skip
    colours = {policy: f"C{number}" for number, policy in enumerate(policies)}

    def minutes(at: float) -> float:
        return (at - start) / 60

    for axes, panel in zip(grid.flat, panels, strict=False):
        if panel.kind == "state-timeline":
            draw_state_timeline(axes, panel, minutes, colours)
        else:
            scale = 100.0 if panel.unit == "percentunit" else 1.0
            for line in panel.lines:
                scaled = [v * scale for v in line.values]
                axes.plot([minutes(t) for t in line.times], scaled, label=line.legend, lw=1)
            if panel.unit == "percentunit":
                axes.set_ylim(0, 100)
            axes.set_ylabel(UNIT_LABELS.get(panel.unit, panel.unit))
            if panel.lines:
                axes.legend(fontsize=7, loc="best")
        for mark in marks:
            axes.axvline(minutes(mark.time), color="orange", linestyle="--", linewidth=0.8)
            if mark.time_end > mark.time:
                axes.axvspan(minutes(mark.time), minutes(mark.time_end), color="orange", alpha=0.2)
        axes.set_title(panel.title, fontsize=10)
        axes.set_xlim(0, (end - start) / 60)
        axes.set_xlabel("minutes", fontsize=8)
        axes.grid(alpha=0.3)
        if not panel.lines:
            axes.text(0.5, 0.5, "No data", ha="center", va="center", transform=axes.transAxes)
    for axes in list(grid.flat)[len(panels) :]:
        axes.axis("off")
    started = datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    figure.suptitle(f"{title}\nfrom {started}; dashed: policy-switch annotations", fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def draw_state_timeline(
    axes: Any, panel: PanelData, minutes: Callable[[float], float], colours: dict[str, str]
) -> None:
    """One bar per pod, coloured by the policy it ran at each step (Grafana's state timeline)."""
    pods = sorted({line.legend.rsplit(": ", 1)[0] for line in panel.lines})
    for line in panel.lines:
        pod, policy = line.legend.rsplit(": ", 1)
        row = pods.index(pod)
        step = min((b - a for a, b in zip(line.times, line.times[1:], strict=False)), default=1)
        spans = [(minutes(t), step / 60) for t, v in zip(line.times, line.values, strict=True)
                 if v == 1]  # fmt: skip
        axes.broken_barh(spans, (row - 0.4, 0.8), color=colours[policy], label=policy)
    axes.set_yticks(range(len(pods)), pods, fontsize=7)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")


def snapshot(
    prometheus: PrometheusServer,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    scrape_interval_s: float,
    path: Path,
) -> Snapshot:
    """Draw ``dashboard`` over [start, end] to ``path``; returns what it showed."""
    panels = fetch_panels(prometheus, dashboard, start, end, scrape_interval_s)
    marks = annotation_events(prometheus, dashboard, start, end, scrape_interval_s)
    draw(panels, marks, start, end, dashboard["title"], path)
    return Snapshot(panels, marks)
