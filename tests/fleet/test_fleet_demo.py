"""A reduced ``make demo-fleet`` (docs/routing.md, "Measured on a local fleet"): the real fleet
of two vLLM servers and the real router, every routing x eviction pair replayed by the real
Locust on a small mixed trace. The assertions are invariants of any such run, not figures.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from arc_dev import fleet_demo
from arc_serving_common.traces import load_trace

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow]

PORT_BASE = 27500  # the demo's default range is 27400; a test never shares it
ROUTING = fleet_demo.DEFAULT_ROUTING
EVICTION = fleet_demo.DEFAULT_EVICTION
# The router logs each consistent_hash decision with the key it hashed (INFO level).
HASH_DECISION = re.compile(r"Consistent hash routing: key='([^']*)' -> worker='([^']*)'")
SESSION_KEY = "header:x-session-id:"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("demo-fleet")
    settings = fleet_demo.parse_args(
        ["--out", str(out), "--sessions", "4", "--documents", "4", "--port-base", str(PORT_BASE)]
    )  # fmt: skip
    assert settings.time_scale is None  # paced to the measured replicas
    assert fleet_demo.run_demo(settings) == 0
    return out, json.loads((out / "fleet.json").read_text())


def test_the_replay_is_paced_to_the_measured_replicas(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    _, report = demo_run
    settings = report["settings"]
    assert settings["time_scale"] > 0
    # Half the replicas' measured capacity if nothing hit (arc_dev.pacing).
    assert settings["utilization_per_replica"] == pytest.approx(0.5)
    assert settings["cost_model"]["prefill_seconds_per_token"] > 0


def test_every_routing_and_eviction_pair_is_measured_and_predicted(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    out, report = demo_run
    pairs = [(r, e) for r in ROUTING for e in EVICTION]
    assert [(run["routing"], run["eviction"]) for run in report["runs"]] == pairs
    assert [(p["routing"], p["eviction"]) for p in report["predictions"]] == pairs
    table = (out / "fleet.md").read_text()
    for routing, eviction in pairs:
        assert re.search(rf"^\| {routing} \| {eviction} \|", table, re.MULTILINE), table


def test_every_run_answers_the_whole_trace_on_two_replicas(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    out, report = demo_run
    planned = len(load_trace(out / "mixed.jsonl", block_tokens=fleet_demo.BLOCK_TOKENS))
    for figures in report["runs"] + report["predictions"]:
        assert figures["requests"] == planned, figures
        assert len(figures["shares"]) == fleet_demo.REPLICAS
        assert sum(figures["shares"]) == pytest.approx(1.0)
        assert 0 <= figures["block_hits"] <= figures["block_queries"]
        assert 0.0 <= figures["block_hit_rate"] <= 1.0


def test_round_robin_alternates_the_replicas(demo_run: tuple[Path, dict[str, Any]]) -> None:
    _, report = demo_run
    for run in report["runs"]:
        if run["routing"] == "round_robin":
            first, second = run["shares"]
            # Strict alternation: the replicas' counts differ by at most one request.
            assert abs(first - second) * run["requests"] <= 1 + 1e-9, run


def test_consistent_hash_keys_every_request_by_its_session(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    out, report = demo_run
    decisions = HASH_DECISION.findall((out / "fleet" / "router.log").read_text(errors="replace"))
    # The load test's own /metrics scrapes through the router carry no session: other keys.
    by_session = [(key, worker) for key, worker in decisions if key.startswith(SESSION_KEY)]
    runs = [run for run in report["runs"] if run["routing"] == "consistent_hash"]
    # Every completion carried X-Session-ID, and each session stayed on one replica.
    assert len(by_session) == sum(run["requests"] for run in runs)
    workers: dict[str, set[str]] = defaultdict(set)
    for key, worker in by_session:
        workers[key].add(worker)
    assert all(len(chosen) == 1 for chosen in workers.values()), workers


def test_an_unknown_routing_policy_exits_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fleet_demo.parse_args(["--out", str(tmp_path / "o"), "--routing", "nearest"])
    assert exit_info.value.code == 2
    assert "--routing: unknown policy 'nearest'; valid: round_robin" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--routing", "kv_aware", "--router-temperature", "-1"], "must be a number >= 0"),
        (["--routing", "kv_aware", "--router-temperature", "nan"], "must be a number >= 0"),
        (["--router-temperature", "5"], "--router-temperature needs --routing kv_aware"),
    ],
)
def test_a_bad_router_temperature_exits_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fleet_demo.parse_args(["--out", str(tmp_path / "o"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_prediction_follows_the_router_temperature(tmp_path: Path) -> None:
    settings = fleet_demo.parse_args(
        ["--out", str(tmp_path), "--routing", "kv_aware", "--router-temperature", "1e9"]
    )
    trace = tmp_path / "mixed.jsonl"
    fleet_demo.write_generated(
        trace,
        fleet_demo.mixed_requests(settings.docqa, settings.conversation),
        "bailian",
        fleet_demo.BLOCK_TOKENS,
    )
    requests = load_trace(trace, block_tokens=fleet_demo.BLOCK_TOKENS)
    capacity = settings.capacity_blocks
    (least_cost,) = fleet_demo.predict(requests, ["kv_aware"], ["lru"], capacity)
    (drawn,) = fleet_demo.predict(
        requests, ["kv_aware"], ["lru"], capacity, temperature=settings.router_temperature
    )
    # At a temperature far above any cost difference the router draws replicas evenly at
    # random, so it places requests unlike the least-cost rule.
    assert drawn.shares != least_cost.shares or drawn.block_hits != least_cost.block_hits
