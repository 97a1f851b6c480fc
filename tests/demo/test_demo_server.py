"""The demo's server steps against the real vLLM (CPU build): with the plugin, the live
switch plus cache reset that gives every policy an empty cache, and one short replay whose
block counts must be the simulator's; without it (the stock row), a server the plugin never
reaches whose replay counts the same blocks from vLLM's own counters. Every TCP socket the
servers, Locust and the demo's Prometheus listen on is sampled the whole time and must be on
loopback. Two small servers for the module (about two minutes)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from arc_dev import demo
from arc_dev.pacing import measure_cost
from arc_harness.listening import ListenerSampler, descendants, sample_listeners
from arc_harness.vllm_server import VllmServer
from arc_serving_common.traces import load_trace
from arc_simulator.simulate import simulate
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPACITY = 64  # blocks: no eviction for the short trace below


@pytest.fixture(scope="module")
def listeners() -> Iterator[ListenerSampler]:
    """Every TCP socket this test process's children listen on, sampled from before the first
    server starts to the module's end."""
    with ListenerSampler(interval_s=0.5) as sampler:
        yield sampler


@pytest.fixture(scope="module")
def server(
    listeners: ListenerSampler, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    folder = tmp_path_factory.mktemp("demo-server")
    srv = demo.demo_server(model_dir, CAPACITY, folder / "policy.json", "lru", folder / "vllm.log")
    with srv:
        yield srv


@pytest.fixture(scope="module")
def stock_server(
    listeners: ListenerSampler, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The demo's server without the plugin, started while this process has a plugin setting
    in its environment: the server must not get it."""
    folder = tmp_path_factory.mktemp("demo-stock")
    srv = demo.demo_server(model_dir, CAPACITY, None, demo.STOCK, folder / "vllm.log")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ARC_EVICTOR_POLICY", "arc")
        srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def stock_session(stock_server: VllmServer) -> demo.ServerSession:
    return demo.ServerSession(
        stock_server.base_url, stock_server.served_model_name, None, stock_server.api_key
    )


@pytest.fixture
def session(server: VllmServer) -> demo.ServerSession:
    policy_file = Path(server.extra_env["ARC_EVICTOR_CONFIG"])
    return demo.ServerSession(
        server.base_url, server.served_model_name, policy_file, server.api_key
    )


PROMPT = [5 + i % 900 for i in range(4 * demo.BLOCK_TOKENS + 5)]  # 4 full blocks + 5 tokens


def test_timing_the_server_runs_real_uncached_and_cached_prompts(
    session: demo.ServerSession,
) -> None:
    session.prepare("lru")
    before = session.counters()
    blocks = 12
    calibration = measure_cost(session.complete, blocks * demo.BLOCK_TOKENS, rounds=3)
    after = session.counters()
    # 3 warm-up prompts and 3 timed ones, each sent uncached, then cached, then cached with
    # more output tokens.
    assert after.requests_finished - before.requests_finished == 2 * 9
    # vLLM computes a prompt's last token, so a cached 12-block prompt hits 11 blocks; the
    # timed prompts share no block with the warm-up's, so they were timed uncached first.
    assert after.block_hits - before.block_hits == 2 * 2 * 3 * (blocks - 1)
    cost = calibration.cost_model()  # valid whatever the timings (CostModel checks its fields)
    assert min(calibration.miss_s, calibration.hit_s, cost.step_seconds) > 0
    assert cost.prefill_seconds_per_token > 0 and cost.decode_seconds_per_token > 0


def hits_of(session: demo.ServerSession, prompt: list[int]) -> float:
    before = session.counters().block_hits
    session.complete(prompt)
    return session.counters().block_hits - before


def test_prepare_switches_policy_and_empties_the_cache(session: demo.ServerSession) -> None:
    session.prepare("lru")
    session.complete(PROMPT)
    assert hits_of(session, PROMPT) == 4  # all four full blocks were cached
    before = time.time()
    session.prepare("arc")
    assert session.counters().active_policy == "arc"
    assert json.loads(session.policy_file.read_text()) == {"policy": "arc"}
    assert hits_of(session, PROMPT) == 0  # the reset emptied the cache
    assert hits_of(session, PROMPT) == 4
    # The switch is logged with when it was asked for and when /metrics reported it; asking
    # for the policy that runs already is no switch.
    (switch,) = [s for s in session.switches if s.written >= before]
    assert switch.policy == "arc" and before <= switch.written <= switch.reported <= time.time()
    session.prepare("arc")
    assert session.switches[-1] == switch


def sequential_trace(folder: Path) -> Path:
    """A short document-QA trace whose replay is sequential on any machine: each question
    waits for the one before (the replay gates a turn on its parent's answer), as the
    simulator's sequential mode serves them."""
    from arc_serving_common.traces import write_trace
    from arc_simulator.generate import DocQAParams, docqa, to_records

    params = DocQAParams(documents=3, document_tokens=200, questions_per_document=2,
                         question_tokens=20, output_tokens=3, seed=1)  # fmt: skip
    records = list(to_records(docqa(params), "bailian", demo.BLOCK_TOKENS))
    for number, record in enumerate(records):
        record["timestamp"] = 0.1 * number
        record["parent_chat_id"] = records[number - 1]["chat_id"] if number else -1
        record["turn"] = number + 1
    trace = folder / "trace.jsonl"
    write_trace(trace, records)
    return trace


def replay(
    session: demo.ServerSession, name: str, trace: Path, model_dir: Path, out: Path
) -> demo.PolicyRun:
    requests = load_trace(trace, block_tokens=demo.BLOCK_TOKENS)
    run_time_s = replay_run_time_s(trace, block_tokens=demo.BLOCK_TOKENS)
    return demo.replay_policy(session, name, trace, out, tokenizer=model_dir, time_scale=1.0,
                              run_time_s=run_time_s, total=len(requests), scheduled_s=1.0,
                              clock=demo.StepClock())  # fmt: skip


def test_replay_counts_the_blocks_the_simulator_counts(
    session: demo.ServerSession, model_dir: Path, tmp_path: Path
) -> None:
    trace = sequential_trace(tmp_path)
    requests = load_trace(trace, block_tokens=demo.BLOCK_TOKENS)
    expected = simulate(requests, "arc", CAPACITY, sequential=True)
    run = replay(session, "arc", trace, model_dir, tmp_path)
    assert run.requests == len(requests) == 6
    rows = [
        json.loads(line) for line in (tmp_path / "arc" / "results.jsonl").read_text().splitlines()
    ]
    spans = sorted((row["sent_wall"], row["sent_wall"] + row["e2e_s"]) for row in rows)
    assert all(end <= sent for (_, end), (sent, _) in itertools.pairwise(spans))
    assert run.block_queries == expected.block_queries
    assert run.block_hits == expected.block_hits > 0
    assert (tmp_path / "arc" / "locust.log").is_file()


def environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def test_the_stock_server_runs_without_the_plugin(
    stock_server: VllmServer, stock_session: demo.ServerSession
) -> None:
    # Its /metrics has none of the plugin's series (parse_counters(plugin=False) refuses them).
    assert stock_session.counters().active_policy is None
    (api_server,) = {item.pid for item in sample_listeners() if item.port == stock_server.port}
    processes = [api_server, *descendants(api_server)]
    assert len(processes) >= 2  # the API server and its engine core, at least
    for pid in processes:
        assert not [name for name in environment_of(pid) if name.startswith("ARC_EVICTOR_")]
    with pytest.raises(demo.DemoError, match="the stock server has no policy file"):
        stock_session.prepare("lru")


def test_stock_replay_counts_the_blocks_the_plugin_counts(
    stock_session: demo.ServerSession,
    session: demo.ServerSession,
    model_dir: Path,
    tmp_path: Path,
) -> None:
    """vLLM's own hit tokens over the block size, on the trace's full prompt blocks, are the
    plugin's block counts: no eviction at this capacity, so stock, lru and the simulator
    agree block for block."""
    trace = sequential_trace(tmp_path)
    requests = load_trace(trace, block_tokens=demo.BLOCK_TOKENS)
    expected = simulate(requests, "lru", CAPACITY, sequential=True)
    stock = replay(stock_session, demo.STOCK, trace, model_dir, tmp_path)
    lru = replay(session, "lru", trace, model_dir, tmp_path)
    assert stock.requests == lru.requests == len(requests)
    assert stock.block_queries == lru.block_queries == expected.block_queries
    assert stock.block_hits == lru.block_hits == expected.block_hits > 0
    assert stock.token_hit_rate == pytest.approx(lru.token_hit_rate)


def test_every_listening_socket_is_on_loopback(
    listeners: ListenerSampler,
    server: VllmServer,
    stock_server: VllmServer,
    tmp_path: Path,
) -> None:
    """The servers, the Locust replays before this test, and the demo's Prometheus (started
    here) listen on 127.0.0.1 or ::1 only."""
    monitor = demo.dashboard_monitor(server, tmp_path / "prometheus.log")
    assert monitor is not None, "no Prometheus binary: `make tools` installs it"
    with monitor:
        monitor.wait_until(lambda: monitor.query("up == 1") != [], demo.SWITCH_TIMEOUT_S,
                           "Prometheus's first scrape of the engine")  # fmt: skip
        listeners.sample()
        ports = {listener.port for listener in listeners.listeners}
        # The sampler saw what it checks: both servers and Prometheus.
        assert {server.port, stock_server.port, monitor.port} <= ports, sorted(ports)
    exposed = [listener.describe() for listener in listeners.exposed()]
    assert not exposed, f"listening beyond loopback: {exposed}"
