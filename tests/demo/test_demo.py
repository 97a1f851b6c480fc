"""The demo's pieces: argument checks, the simulator's prediction for the demo trace, the
table, gain lines and plot built from real load-test summaries, the plugin-counter scrape.
The real-server steps (switch, reset, replay) are in ``test_demo_server.py``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from arc_dev import demo, snapshot
from arc_dev.demo import DemoError, PolicyRun, Prediction
from arc_evictor.vllm_plugin.metrics import PluginMetrics
from arc_harness.prometheus import load_dashboard
from arc_loadtest.report import CacheCounters, summarize


def make_row(ttft_s: float, *, ok: bool = True, lag_s: float = 0.001) -> dict:
    """A per-request row in the locustfile's shape (the fields ``summarize`` reads)."""
    return {
        "ok": ok,
        "ttft_s": ttft_s if ok else None,
        "itl_s": [0.008, 0.010, 0.012] if ok else [],
        "e2e_s": ttft_s + 0.030,
        "output_tokens": 4 if ok else 0,
        "lag_s": lag_s,
        "held_s": 0.0,
    }


def make_run(policy: str, ttfts: list[float], hits: float, queries: float) -> PolicyRun:
    summary = summarize(
        [make_row(t) for t in ttfts],
        planned=len(ttfts),
        start=CacheCounters(hits=0, queries=0),
        end=CacheCounters(hits=hits * 32, queries=queries * 32),
        duration_s=10.0,
    )
    return PolicyRun(policy, summary, block_queries=queries, block_hits=hits)


CHART = Path(__file__).resolve().parents[2] / "charts" / "arc-serving"
PREDICTIONS = [Prediction("lru", 0.38, 0.39, 0.26), Prediction("arc", 0.50, 0.49, 0.18)]


# --------------------------------------------------------------------------- arguments
def test_defaults_compare_lru_arc_and_the_charts_policy_at_the_tuned_capacity(
    tmp_path: Path,
) -> None:
    settings = demo.parse_args(["--out", str(tmp_path / "o")])
    assert settings.policies == ("lru", "arc", "trio")
    # The last default run is the policy the chart deploys.
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert values["servingPolicy"]["policy"].lower() == settings.policies[-1]
    assert settings.capacity_blocks == demo.CAPACITY_BLOCKS
    assert settings.trace == demo.TRACE
    assert settings.stock  # the same server without the plugin runs too
    assert not demo.parse_args(["--no-stock"]).stock
    assert not (tmp_path / "o").exists()  # parsing creates nothing


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "lru,fifo"], "unknown policy 'fifo'; valid policies: "),
        (["--policies", "arc"], "at least two distinct policies"),
        (["--policies", "arc,ARC"], "at least two distinct policies"),
        (["--capacity", "10"], "--capacity must be at least 64 blocks"),
        (["--time-scale", "0"], "--time-scale must be auto or in (0, 100], got '0'"),
        (["--time-scale", "fast"], "--time-scale must be auto or in (0, 100], got 'fast'"),
        (["--seed", "-1"], "--seed must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem_and_write_nothing(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        demo.main(["--out", str(out), *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_out_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "file"
    target.write_text("keep")
    with pytest.raises(SystemExit):
        demo.main(["--out", str(target), "--simulate-only"])
    assert "exists and is not a folder" in capsys.readouterr().err
    assert target.read_text() == "keep"


def test_unknown_policy_message_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        demo.parse_args(["--policies", "lru,nope"])
    err = capsys.readouterr().err
    assert "lru" in err.split("valid policies:")[1] and "arc" in err.split("valid policies:")[1]


# ---------------------------------------------------------------- simulator prediction
def test_simulate_only_predicts_a_clear_arc_win_on_the_demo_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main(["--out", str(tmp_path), "--simulate-only"]) == 0
    assert (tmp_path / "docqa.jsonl").is_file()
    assert not (tmp_path / "model").exists()  # no model, no server
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("lru ", "arc "))}
    lru_seq, lru_ovl = float(rows["lru"][1]), float(rows["lru"][2])
    arc_seq, arc_ovl = float(rows["arc"][1]), float(rows["arc"][2])
    # The demo's trace and capacity were chosen for this: ARC ahead by 5+ points both ways.
    assert arc_seq - lru_seq >= 0.05
    assert arc_ovl - lru_ovl >= 0.05


def test_demo_trace_fits_the_server() -> None:
    from arc_simulator.generate import docqa

    longest = max(request.input_length for request in docqa(demo.TRACE))
    assert longest + demo.TRACE.output_tokens * 2 <= demo.MAX_MODEL_LEN
    assert demo.MAX_MODEL_LEN <= demo.CAPACITY_BLOCKS * demo.BLOCK_TOKENS


# ------------------------------------------------------------------ table and gains
def test_table_has_every_column_with_measured_next_to_predicted() -> None:
    runs = [make_run("lru", [0.30, 0.26, 0.20], 38, 100), make_run("arc", [0.2, 0.1, 0.3], 50, 100)]
    table = demo.comparison_table(runs, PREDICTIONS)
    header, _rule, lru, arc = table.splitlines()
    for column in ("policy", "requests", "block hit", "sim seq", "sim ovl", "TTFT p50 ms",
                   "TTFT p90 ms", "p50/stock", "p50/lru", "ITL p50 ms", "req/s",
                   "lag p99 ms"):  # fmt: skip
        assert column in header
    assert lru.split()[:6] == ["lru", "3", "0.380", "0.380", "0.390", "0.380"]
    assert arc.split()[:4] == ["arc", "3", "0.500", "0.500"]
    assert lru.split()[6] == "260"  # TTFT p50 of 0.30, 0.26, 0.20
    assert lru.split()[8:10] == ["-", "1.00x"]  # no stock run; lru over itself
    assert arc.split()[9] == f"{0.2 / 0.26:.2f}x"
    assert arc.split()[10] == "10"  # ITL p50 of the gaps 8, 10 and 12 ms


def test_stock_row_comes_first_with_lrus_prediction_and_every_ttft_over_it() -> None:
    stock = make_run("stock", [0.25, 0.25, 0.25], 38, 100)
    runs = [make_run("lru", [0.30, 0.26, 0.20], 38, 100), make_run("arc", [0.2, 0.1, 0.3], 50, 100)]
    _header, _rule, *rows = demo.comparison_table(runs, PREDICTIONS, stock).splitlines()
    assert [row.split()[0] for row in rows] == ["stock", "lru", "arc"]
    stock_row, lru_row, arc_row = (row.split() for row in rows)
    # Stock vLLM evicts least recently used first: the simulator's lru stands for it.
    assert stock_row[2:5] == ["0.380", "0.380", "0.390"]
    assert stock_row[8:10] == ["1.00x", f"{0.25 / 0.26:.2f}x"]
    assert lru_row[8] == f"{0.26 / 0.25:.2f}x"
    assert arc_row[8] == f"{0.2 / 0.25:.2f}x"


def test_stock_lines_hold_stocks_hit_rate_to_lrus_within_half_a_point() -> None:
    runs = [make_run("lru", [0.26] * 3, 380, 1000), make_run("arc", [0.2] * 3, 500, 1000)]
    close = demo.stock_lines(make_run("stock", [0.25] * 3, 376, 1000), runs)
    assert close[0].startswith("target stock block hit rate = the plugin's lru within 0.5 point")
    assert ": met (" in close[0]
    assert "(0.376 vs 0.380, +0.40 points)" in close[0]
    assert close[1] == "TTFT p50 lru vs stock: +4.0% (slower), p90 1.04x of stock's"
    assert close[2] == "TTFT p50 arc vs stock: -20.0% (faster), p90 0.80x of stock's"
    apart = demo.stock_lines(make_run("stock", [0.25] * 3, 374, 1000), runs)
    assert "0.5 point: MISSED (0.374 vs 0.380, +0.60 points)" in apart[0]


def test_zero_query_run_shows_dashes_and_gains_refuse_it() -> None:
    empty = PolicyRun("lru", summarize([], planned=0, start=None, end=None, duration_s=0.0),
                      block_queries=0, block_hits=0)  # fmt: skip
    row = demo.comparison_table([empty], []).splitlines()[2].split()
    assert row == ["lru", "0"] + ["-"] * 11
    with pytest.raises(ValueError, match="no block queries were counted for lru or arc"):
        demo.gains([empty, make_run("arc", [0.1], 5, 10)])


def test_gain_lines_report_points_relative_and_ttft_and_judge_the_target() -> None:
    # Hit rate 0.40 -> 0.50: +10 points, +25% relative; TTFT p50 0.200 -> 0.160: +20%.
    runs = [make_run("lru", [0.2] * 5, 40, 100), make_run("arc", [0.16] * 5, 50, 100)]
    (gain,) = demo.gains(runs)
    assert gain.hit_points == pytest.approx(10.0)
    assert gain.hit_relative == pytest.approx(0.25)
    assert gain.ttft_p50_relative == pytest.approx(0.2)
    assert gain.ttft_target_met is True
    lines = demo.gain_lines(runs)
    assert lines[0] == "hit gain (arc vs lru): +10.0 points of block hit rate, +25.0% relative"
    assert lines[1] == "TTFT p50 gain (arc vs lru): +20.0% (positive = faster)"
    assert lines[2].endswith("met: needs >= 12.5% (half of +25.0%), got +20.0%")
    assert lines[3] == "target dispatch lag p99 < 50 ms: met (worst run 1.0 ms)"


def test_ttft_gain_below_half_the_hit_gain_is_reported_missed() -> None:
    runs = [make_run("lru", [0.2] * 5, 40, 100), make_run("arc", [0.19] * 5, 50, 100)]
    assert demo.gains(runs)[0].ttft_target_met is False
    assert "MISSED: needs >= 12.5%" in demo.gain_lines(runs)[2]


def test_target_does_not_apply_when_arc_does_not_beat_lru() -> None:
    runs = [make_run("lru", [0.2] * 5, 50, 100), make_run("arc", [0.25] * 5, 45, 100)]
    (gain,) = demo.gains(runs)
    assert gain.hit_points == pytest.approx(-5.0)
    assert gain.ttft_target_met is None
    assert "not applicable: arc did not beat lru's hit rate" in demo.gain_lines(runs)[2]


def test_slow_dispatch_misses_the_lag_target() -> None:
    slow = summarize([make_row(0.2, lag_s=0.08)] * 4, planned=4, start=None, end=None,
                     duration_s=1.0)  # fmt: skip
    runs = [make_run("lru", [0.2] * 4, 40, 100), PolicyRun("arc", slow, 100, 50)]
    assert (
        demo.gain_lines(runs)[-1] == "target dispatch lag p99 < 50 ms: MISSED (worst run 80.0 ms)"
    )


def test_plot_is_written(tmp_path: Path) -> None:
    runs = [make_run("stock", [0.3, 0.2], 38, 100), make_run("lru", [0.3, 0.2], 38, 100),
            make_run("arc", [0.2, 0.1], 50, 100)]  # fmt: skip
    path = demo.plot_comparison(runs, PREDICTIONS, tmp_path / "sub" / "demo.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_a_long_title_is_broken_into_lines_that_fit_the_figure(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    title = ("doc-QA trace, 600 requests, cache 1200 blocks of 16 tokens; vLLM CPU build, one "
             "server, policy switched live; stock: the same server without the plugin")  # fmt: skip
    figure, _ = plt.subplots(1, 2, figsize=(10, 4.2))
    demo.save_figure(figure, tmp_path / "figure.png", title)
    text = figure.texts[0]  # the suptitle
    # save_figure closed the figure: a new canvas renders it again, as saved.
    extent = text.get_window_extent(FigureCanvasAgg(figure).get_renderer())
    assert extent.x0 >= 0.02 * figure.bbox.width and extent.x1 <= 0.98 * figure.bbox.width
    assert text.get_text().count("\n") == 1 and text.get_text().replace("\n", " ") == title


# ------------------------------------------------------------------ plugin counters
def plugin_metrics_page(hits: int, queries: int, active: str) -> str:
    """The exposition text of the plugin's real metric objects."""
    registry = CollectorRegistry()
    metrics = PluginMetrics(registry)
    metrics.block_hits.inc(hits)
    metrics.block_queries.inc(queries)
    for name in ("lru", "arc"):
        metrics.policy_info.labels(policy=name).set(1 if name == active else 0)
    return generate_latest(registry).decode()


def test_plugin_counters_are_read_from_the_plugin_metrics() -> None:
    counters = demo.parse_counters(plugin_metrics_page(7, 20, "arc"))
    assert (counters.block_hits, counters.block_queries, counters.active_policy) == (7, 20, "arc")


def test_missing_plugin_metrics_name_the_cause() -> None:
    with pytest.raises(DemoError, match="no arc_evictor_block_hits_total, arc_evictor_block_qu"):
        demo.parse_counters("vllm:prefix_cache_hits_total 3.0\n")


def test_stock_counters_are_vllms_own_and_refuse_the_plugins() -> None:
    page = "vllm:prefix_cache_hits_total 96.0\nvllm:request_success_total 4.0\n"
    counters = demo.parse_counters(page, plugin=False)
    assert (counters.prefix_hit_tokens, counters.requests_finished) == (96, 4)
    assert (counters.block_hits, counters.block_queries, counters.active_policy) == (0, 0, None)
    with pytest.raises(DemoError, match="the stock server's /metrics has arc_evictor_block_hits"):
        demo.parse_counters(plugin_metrics_page(7, 20, "arc"), plugin=False)


def test_a_server_without_the_plugin_runs_stock_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a server without the plugin runs 'stock', not 'lru'"):
        demo.demo_server(tmp_path, 64, None, "lru", tmp_path / "vllm.log")


# ---------------------------------------------------------------- dashboard snapshot
def test_snapshot_legends_follow_grafanas_legend_format() -> None:
    labels = {"namespace": "ns", "pod": "p-0", "policy": "arc"}
    assert snapshot.legend_text("{{namespace}}/{{pod}}: {{policy}}", labels) == "ns/p-0: arc"
    assert snapshot.legend_text("p99", labels) == "p99"


def test_snapshot_draws_the_main_dashboards_panels(tmp_path: Path) -> None:
    dashboard = load_dashboard("overview.json")
    times = [1000.0 + second for second in range(120)]
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        legend = "ns/p-0: lru" if panel["type"] == "state-timeline" else "p50"
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        line = snapshot.Line(legend, times, [1.0] * len(times))
        panels.append(snapshot.PanelData(panel["title"], panel["type"], unit, [line]))
    assert len(panels) == 10
    marks = [snapshot.AnnotationEvent(1030.0, 1030.0, 15.0),
             snapshot.AnnotationEvent(1060.0, 1075.0, 15.0)]  # fmt: skip
    path = snapshot.draw(panels, marks, 1000.0, 1120.0, "title", tmp_path / "d.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 50_000


def test_marks_one_step_apart_merge_into_one_region_as_grafana_does() -> None:
    events = snapshot.merged_events([1030.0, 1000.0, 1015.0, 1060.0], 15.0)
    assert [(e.time, e.time_end) for e in events] == [(1000.0, 1030.0), (1060.0, 1060.0)]
    assert snapshot.merged_events([], 15.0) == []


SWITCHES = [snapshot.Switch("arc", 1000.0, 1000.4), snapshot.Switch("trio", 1200.0, 1200.3)]


def mark(at: float) -> snapshot.AnnotationEvent:
    return snapshot.AnnotationEvent(at, at, 15.0)


def test_each_switch_must_have_one_mark_within_a_scrape_and_a_step_after_it() -> None:
    # Within 15 s of scrape and 15 s of step after the report: 1030.4 and 1230.3 at the latest.
    assert snapshot.switch_mark_problems(SWITCHES, [mark(1030.0), mark(1215.0)], 15.0) == []
    late, early, doubled = (
        snapshot.switch_mark_problems(SWITCHES, marks, 15.0)
        for marks in ([mark(1031.0), mark(1215.0)], [mark(999.0), mark(1215.0)],
                      [mark(1015.0), mark(1030.0), mark(1215.0)])
    )  # fmt: skip
    assert late[0].startswith("the switch to arc (written 1000.0, reported 1000.4) has 0 marks")
    assert late[1] == "marks with no switch before them: [1031.0]"
    assert early[1] == "marks with no switch before them: [999.0]"
    assert doubled == [
        "the switch to arc (written 1000.0, reported 1000.4) has 2 marks within one scrape and "
        "one step after it: [1015.0, 1030.0]"
    ]
    assert snapshot.switch_mark_problems(SWITCHES[:1], [mark(1010.0), mark(1100.0)], 15.0) == [
        "marks with no switch before them: [1100.0]"
    ]


def test_sigterm_unwinds_the_demo_so_its_servers_are_stopped(tmp_path: Path) -> None:
    """A demo's servers run in process groups of their own: only the demo's own clean-up
    stops them, so SIGTERM must unwind it as Ctrl-C does."""
    stopped = tmp_path / "stopped"
    script = (
        "import sys, time\n"
        "from arc_dev.demo import stop_on_sigterm\n"
        "stop_on_sigterm()\n"
        "try:\n"
        "    print('serving', flush=True)\n"
        "    time.sleep(120)\n"
        "finally:\n"
        f"    open({str(stopped)!r}, 'w').write('stopped')\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdout.readline() == "serving\n"
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert stopped.read_text() == "stopped"
