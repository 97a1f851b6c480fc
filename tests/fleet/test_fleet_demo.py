"""A reduced ``make demo-fleet`` (docs/routing.md, "Measured on a local fleet"): the real fleet
of two vLLM servers and the real router, every routing policy (under one eviction policy)
replayed by the real Locust on a small mixed trace. The assertions are invariants of any such
run, not figures. Every TCP socket the fleet and Locust listen on is sampled during the run and
must be on loopback.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arc_dev import fleet_demo
from arc_dev.fleet_decisions import DecisionRecordError, predict_on_placement, read_decisions
from arc_harness.fleet import ROUTER_PORT_OFFSET, server_port, server_url
from arc_harness.listening import ListenerSampler
from arc_serving_common.names import KV_AWARE_ROUTER_TEMPERATURE
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.fleet import simulate_fleet
from arc_simulator.routing import ConsistentHashRouter

# Exclusive: the decisions are joined to the records within a fixed time boundary
# (arc_dev.fleet_decisions.BOUNDARY_S), which a machine busy with other tests overruns.
pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow, pytest.mark.exclusive]

PORT_BASE = 27500  # the demo's default range is 27400; a test never shares it
ROUTING = fleet_demo.DEFAULT_ROUTING
# One eviction policy: every routing policy meets the real router, and each run costs a paced
# replay; live switching has tests of its own (tests/faults/test_live_switch.py).
EVICTION = ("trio",)
# How far a recorded run's hit rate may be from the model's on the placement its router made.
PLACED_TOLERANCE = 0.05
# The router logs each consistent_hash decision with the key it hashed (INFO level).
HASH_DECISION = re.compile(r"Consistent hash routing: key='([^']*)' -> worker='([^']*)'")
SESSION_KEY = "header:x-session-id:"


@pytest.fixture(scope="module")
def listeners() -> Iterator[ListenerSampler]:
    """Every TCP socket this test process's children listen on, sampled from before the demo
    starts its fleet to the module's end."""
    with ListenerSampler(interval_s=0.5) as sampler:
        yield sampler


@pytest.fixture(scope="module")
def demo_run(
    listeners: ListenerSampler, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("demo-fleet")
    settings = fleet_demo.parse_args(
        ["--out", str(out), "--sessions", "4", "--documents", "4", "--port-base", str(PORT_BASE),
         "--eviction", ",".join(EVICTION), "--record-decisions"]
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
    # A quarter of the replicas' measured capacity if nothing hit (arc_dev.pacing).
    assert settings["utilization_per_replica"] == pytest.approx(fleet_demo.UTILIZATION)
    assert settings["cost_model"]["prefill_seconds_per_token"] > 0


def test_every_routing_and_eviction_pair_is_measured_and_predicted(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    out, report = demo_run
    pairs = [(r, e) for r in (*ROUTING, fleet_demo.ONE_CACHE) for e in EVICTION]
    assert [(run["routing"], run["eviction"]) for run in report["runs"]] == pairs
    assert [(p["routing"], p["eviction"]) for p in report["predictions"]] == pairs
    table = (out / "fleet.md").read_text()
    for routing, eviction in pairs:
        assert re.search(rf"^\| {routing} \| {eviction} \|", table, re.MULTILINE), table


def test_every_run_answers_the_whole_trace_on_two_replicas_or_one_big_cache(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    out, report = demo_run
    planned = len(load_trace(out / "mixed.jsonl", block_tokens=fleet_demo.BLOCK_TOKENS))
    for figures in report["runs"] + report["predictions"]:
        assert figures["requests"] == planned, figures
        one_cache = figures["routing"] == fleet_demo.ONE_CACHE
        assert len(figures["shares"]) == (1 if one_cache else fleet_demo.REPLICAS)
        assert sum(figures["shares"]) == pytest.approx(1.0)
        assert 0 <= figures["block_hits"] <= figures["block_queries"]
        assert 0.0 <= figures["block_hit_rate"] <= 1.0


def test_each_routed_run_reports_what_it_keeps_of_one_big_cache(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    """One server of both replicas' blocks replays the same trace at the same pace; every row
    divides its hit rate by that run's (same eviction policy). Splitting each conversation
    over two caches at random, round robin keeps least of it."""
    out, report = demo_run
    one = {r["eviction"]: r for r in report["runs"] if r["routing"] == fleet_demo.ONE_CACHE}
    assert set(one) == set(EVICTION)
    for run in report["runs"]:
        best = one[run["eviction"]]["block_hit_rate"]
        assert run["of_one_cache"] == pytest.approx(run["block_hit_rate"] / best)
        if run["routing"] == "round_robin":
            assert run["block_hit_rate"] < best, (run, best)
    log = (out / "one-cache" / "server-0.log").read_text(errors="replace")
    capacity = fleet_demo.CAPACITY_BLOCKS * fleet_demo.REPLICAS
    # The plugin's own start-up line: vLLM's pool, its null block included.
    assert f"arc_evictor: block pool of {capacity + 1} blocks" in log, log[-3000:]
    assert re.search(r"^\| one_cache \| trio \| .* \| 1\.00 \|", (out / "fleet.md").read_text(),
                     re.MULTILINE)  # fmt: skip


def test_every_run_reports_how_busy_the_replicas_were(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    _, report = demo_run
    assert all(run["in_flight"] > 0 for run in report["runs"]), report["runs"]
    # The model's own figure beside it, from its modelled service times.
    assert all(prediction["in_flight"] > 0 for prediction in report["predictions"])


def test_in_flight_is_the_requests_time_over_the_span_per_replica(tmp_path: Path) -> None:
    rows = [
        {"ok": True, "sent_s": 0.0, "e2e_s": 2.0},
        {"ok": True, "sent_s": 1.0, "e2e_s": 3.0},  # the span is 0 s to 4 s
        {"ok": False, "sent_s": 9.0, "e2e_s": None},
    ]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert fleet_demo.mean_in_flight(results, replicas=2) == pytest.approx(5.0 / 4.0 / 2)


def test_router_decisions_are_recorded_and_joined(demo_run: tuple[Path, dict[str, Any]]) -> None:
    """--record-decisions: each kv_aware request's router decision next to the servers' KV
    events; the simulator's rule makes the router's choice from that state (a few may fall
    where the router and the load test stamp a change differently), and vLLM reports what it
    served from cache. Each kv_aware and cache_aware run's placement, read from the router's
    log, is the one vLLM's request counters saw, and the model predicts the run on it."""
    out, report = demo_run
    for run in report["runs"]:
        if run["routing"] not in fleet_demo.RECORDED:
            assert run["decisions"] is None
            continue
        # The placement read from the router's log is the one vLLM's request counters saw.
        placed = run["decisions"]["on_recorded_placement"]
        assert placed["shares"] == pytest.approx(run["shares"]), run
        assert placed["in_flight"] > 0.0
        # Given the placement, the model of the caches is close (docs/routing.md: within 2
        # points on the demo's trace, quiet or with a busy core; within a point here).
        assert abs(placed["block_hit_rate"] - run["block_hit_rate"]) <= PLACED_TOLERANCE, run
        if run["routing"] != "kv_aware":
            continue
        run_dir = out / f"kv_aware-{run['eviction']}"
        assert (run_dir / "kv_events.jsonl").stat().st_size > 0
        decisions = read_decisions(run_dir / "decisions.jsonl")
        assert len(decisions) == run["requests"] == run["decisions"]["decisions"]
        assert sum(d.explained() for d in decisions) >= 0.9 * len(decisions)
        assert all(d.served_cached_tokens is not None for d in decisions)
        # Some request found a prefix published, and the router credited it.
        assert any(d.router_credited_tokens > 0 and d.credit_matches for d in decisions)


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
    ("routing", "message"),
    [
        ("kv_aware:temperature=-1", "'kv_aware:temperature=-1': --router-temperature must be"),
        ("kv_aware:temperature=nan", "--router-temperature must be a finite number >= 0"),
        ("kv_aware:temperature=warm", "temperature must be a number, got 'warm'"),
        ("kv_aware:affinity-ttl=0", "affinity TTL must be whole seconds from 1 to 31536000"),
        ("kv_aware:affinity-ttl=1.5", "affinity-ttl must be a whole number, got '1.5'"),
        ("kv_aware:temperature=1:temperature=2", "(it takes temperature=VALUE, affinity-ttl"),
        ("round_robin:temperature=5", "'temperature=5' is not an argument of round_robin"),
        ("kv_aware:cache-threshold=0.5", "'cache-threshold=0.5' is not an argument of kv_aware"),
        ("cache_aware:cache-threshold=1.5", "--cache-threshold must be between 0 and 1"),
        ("cache_aware:balance-abs-threshold=-1", "--balance-abs-threshold must be >= 0"),
        ("cache_aware:balance-rel-threshold=0.5", "--balance-rel-threshold must be a number >= 1"),
        ("kv_aware,kv_aware:temperature=1", "needs distinct comma-separated entries"),
    ],
)
def test_bad_router_arguments_exit_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], routing: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        fleet_demo.parse_args(["--out", str(tmp_path / "o"), "--routing", routing])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def demo_requests(settings: fleet_demo.FleetDemoSettings, folder: Path) -> list[TraceRequest]:
    """The demo's mixed trace for ``settings``, written and read back as the demo does."""
    trace = folder / "mixed.jsonl"
    fleet_demo.write_generated(
        trace,
        fleet_demo.mixed_requests(settings.docqa, settings.conversation),
        "bailian",
        fleet_demo.BLOCK_TOKENS,
    )
    return load_trace(trace, block_tokens=fleet_demo.BLOCK_TOKENS)


def test_the_prediction_follows_each_entrys_router_arguments(tmp_path: Path) -> None:
    settings = fleet_demo.parse_args(
        ["--out", str(tmp_path), "--routing",
         "kv_aware:temperature=0,kv_aware:temperature=1e9,kv_aware:temperature=0:affinity-ttl=600"]
    )  # fmt: skip
    requests = demo_requests(settings, tmp_path)
    least_cost, drawn, sticky = fleet_demo.predict(
        requests, settings.routing, ["lru"], settings.capacity_blocks
    )
    assert [p.routing for p in (least_cost, drawn, sticky)] == [
        "kv_aware:temperature=0", "kv_aware:temperature=1e+09",
        "kv_aware:temperature=0:affinity-ttl=600",
    ]  # fmt: skip
    # At a temperature far above any cost difference the router draws replicas evenly at
    # random, so it places requests unlike the least-cost rule; so does keeping sessions.
    for other in (drawn, sticky):
        assert other.shares != least_cost.shares or other.block_hits != least_cost.block_hits


def test_a_router_that_draws_is_predicted_over_seeds(tmp_path: Path) -> None:
    settings = fleet_demo.parse_args(["--out", str(tmp_path), "--routing", "kv_aware,round_robin"])
    requests = demo_requests(settings, tmp_path)
    drawn, fixed = fleet_demo.predict(requests, settings.routing, ["lru"], settings.capacity_blocks)
    # kv_aware at the operator's temperature draws its ties: the mean of the seeds, and
    # their spread.
    rates = [
        simulate_fleet(
            requests, "lru", settings.capacity_blocks, fleet_demo.REPLICAS, "kv_aware",
            sequential=False, cost=fleet_demo.COST, seed=seed,
            temperature=KV_AWARE_ROUTER_TEMPERATURE,
        )[0].block_hit_rate
        for seed in range(fleet_demo.PREDICTION_SEEDS)
    ]  # fmt: skip
    assert drawn.seeds == fleet_demo.PREDICTION_SEEDS
    assert drawn.block_hit_rate == pytest.approx(sum(rates) / len(rates))
    assert drawn.block_hit_low is not None and drawn.block_hit_high is not None
    assert min(rates) <= drawn.block_hit_low < drawn.block_hit_high <= max(rates)
    assert drawn.shares[0] >= drawn.shares[1]  # largest first
    # Round robin draws nothing: one run, no spread.
    assert (fixed.seeds, fixed.block_hit_low, fixed.block_hit_high) == (1, None, None)
    assert "(" in fleet_demo.table_rows([drawn], [drawn])[0][4]


def test_the_model_on_a_recorded_placement_is_the_model_of_that_placement(
    tmp_path: Path,
) -> None:
    """Replaying the placement a router made reproduces that router's run exactly, so what
    the prediction on a run's placement leaves out is the router, nothing else."""
    settings = fleet_demo.parse_args(["--out", str(tmp_path)])
    requests = demo_requests(settings, tmp_path)
    capacity, replicas = settings.capacity_blocks, fleet_demo.REPLICAS
    routed, placement = simulate_fleet(
        requests, "trio", capacity, replicas, "kv_aware", sequential=False,
        cost=fleet_demo.COST, seed=3, temperature=KV_AWARE_ROUTER_TEMPERATURE,
    )  # fmt: skip
    recorded = {request.index: worker for request, worker in zip(requests, placement, strict=True)}
    replayed = predict_on_placement(requests, recorded, "trio", capacity, replicas, fleet_demo.COST)
    assert replayed.block_hits == routed.block_hits
    assert replayed.block_queries == routed.block_queries
    assert replayed.request_shares == routed.request_shares
    # Another placement is another prediction.
    swapped = {index: 1 - worker if index % 3 else worker for index, worker in recorded.items()}
    other = predict_on_placement(requests, swapped, "trio", capacity, replicas, fleet_demo.COST)
    assert other.block_hits != routed.block_hits
    missing = {i: w for i, w in recorded.items() if i != requests[5].index}
    with pytest.raises(DecisionRecordError, match=f"request {requests[5].index} has no"):
        predict_on_placement(requests, missing, "trio", capacity, replicas, fleet_demo.COST)


def test_cache_aware_thresholds_reach_the_router_and_the_prediction(tmp_path: Path) -> None:
    settings = fleet_demo.parse_args(
        [
            "--out",
            str(tmp_path),
            "--routing",
            "cache_aware,cache_aware:balance-abs-threshold=0:balance-rel-threshold=1",
        ]
    )
    assert [routing.label for routing in settings.routing] == [
        "cache_aware", "cache_aware:balance-abs-threshold=0:balance-rel-threshold=1",
    ]  # fmt: skip
    defaults, balanced = settings.routing
    assert defaults.router_args() == []  # the router's own defaults
    assert balanced.router_args() == [
        "--cache-threshold", "0.3", "--balance-abs-threshold", "0", "--balance-rel-threshold",
        "1.0",
    ]  # fmt: skip
    requests = demo_requests(settings, tmp_path)
    defaults, balanced = fleet_demo.predict(
        requests, settings.routing, ["lru"], settings.capacity_blocks
    )
    # Balancing whenever loads differ at all spreads requests the prefix tree would pile up.
    assert max(balanced.shares) < max(defaults.shares)


def test_the_simulator_places_every_session_where_the_router_did(
    demo_run: tuple[Path, dict[str, Any]],
) -> None:
    out, _ = demo_run
    decisions = HASH_DECISION.findall((out / "fleet" / "router.log").read_text(errors="replace"))
    urls = [server_url(PORT_BASE, index) for index in range(fleet_demo.REPLICAS)]
    ring = ConsistentHashRouter(fleet_demo.REPLICAS, worker_urls=urls)
    # Every key the router hashed, the load test's sessions and its own scrapes alike.
    placed = {key: worker for key, worker in decisions}
    assert len(placed) > 4
    assert {key: urls[ring.worker_for_key(key)] for key in placed} == placed


def test_kv_aware_runs_at_the_operators_temperature_unless_told(tmp_path: Path) -> None:
    (kv_aware,) = [
        routing
        for routing in fleet_demo.parse_args(["--out", str(tmp_path)]).routing
        if routing.policy == "kv_aware"
    ]
    assert kv_aware.temperature == KV_AWARE_ROUTER_TEMPERATURE
    assert kv_aware.router_args() == ["--router-temperature", "1.0"]
    least_cost, sticky = fleet_demo.parse_routing(
        "kv_aware:temperature=0, KV_aware : affinity-ttl = 60"
    )
    assert least_cost.router_args() == ["--router-temperature", "0.0"]
    assert sticky.router_args() == [
        "--router-temperature", "1.0", "--kv-aware-session-affinity-ttl-secs", "60",
    ]  # fmt: skip


def test_every_listening_socket_is_on_loopback(
    listeners: ListenerSampler, demo_run: tuple[Path, dict[str, Any]]
) -> None:
    """The servers' HTTP ports and KV-event publishers and the router listen on 127.0.0.1 or
    ::1 only, as does anything else the run started (Locust)."""
    ports = {listener.port for listener in listeners.listeners}
    servers = [server_port(PORT_BASE, index) for index in range(fleet_demo.REPLICAS)]
    # The sampler saw what it checks: each server and its event publisher, the router and its
    # metrics port.
    router = PORT_BASE + ROUTER_PORT_OFFSET
    expected = {*servers, *(port + 1 for port in servers), router, router + 1}
    assert expected <= ports, sorted(ports)
    exposed = [listener.describe() for listener in listeners.exposed()]
    assert not exposed, f"listening beyond loopback: {exposed}"
