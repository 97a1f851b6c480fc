"""End to end: the real vLLM OpenAI server (CPU build) with the plugin, a tiny local Llama.

One server for the module (a start takes about 40 s on two cores). The cache is forced small
(``--num-gpu-blocks-override 17``: 16 cacheable blocks of 32 tokens), prompts are token-id
lists of whole blocks plus one token, so every full block can be a hit.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from arc_harness.vllm_server import VllmServer, VllmServerError
from arc_serving_common.names import CONFIG_ENV, METRIC_NAMES, POLICY_ENV, POLL_MS_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
NUM_BLOCKS = 17


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy") / "policy.json"
    path.write_text(json.dumps({"policy": "lru"}))
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path, config_file: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    env = {CONFIG_ENV: str(config_file), POLL_MS_ENV: "100"}
    with VllmServer(
        model_dir,
        block_size=BLOCK,
        num_gpu_blocks=NUM_BLOCKS,
        served_model_name="tiny",
        env=env,
        log_path=log,
    ) as srv:
        print(f"vLLM server started in {srv.startup_seconds:.1f} s")
        yield srv


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1024) for _ in range(blocks * BLOCK + 1)]


def complete(srv: VllmServer, tokens: list[int], max_tokens: int = 1) -> dict:
    body = json.dumps(
        {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        f"{srv.base_url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", **srv.auth_headers},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def metrics(srv: VllmServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{srv.base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "pid"))
            out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))


SWITCH_TIMEOUT_S = 60.0  # a slow, busy machine; each wait ends as soon as the switch is seen


def wait_for(srv: VllmServer, check, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(srv)
        if check(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_metrics_are_exported_with_the_design_names(server: VllmServer) -> None:
    m = wait_for(server, lambda m: value(m, "arc_evictor_policy_info", policy="lru") == 1)
    names = {n for n, _ in m}
    for name in METRIC_NAMES:
        assert any(n == name or n.startswith(name + "_") for n in names), name
    assert value(m, "arc_evictor_policy_info", policy="lru") == 1
    assert value(m, "arc_evictor_policy_info", policy="arc") == 0


def test_lru_hits_and_evictions_move_as_predicted(server: VllmServer) -> None:
    before = metrics(server)
    hot = prompt(1, 4)
    complete(server, hot)
    complete(server, hot)  # the 4 full blocks are hits
    m = wait_for(
        server,
        lambda m: (
            value(m, "arc_evictor_block_hits_total")
            >= value(before, "arc_evictor_block_hits_total") + 4
        ),
    )
    assert (
        value(m, "arc_evictor_block_hits_total") - value(before, "arc_evictor_block_hits_total")
        == 4
    )
    vllm_hits = value(m, "vllm:prefix_cache_hits_total") - value(
        before, "vllm:prefix_cache_hits_total"
    )
    assert vllm_hits == 4 * BLOCK
    # Five cold 4-block prompts (20 blocks) stream through 16 cacheable blocks: LRU evicts
    # the hot prompt, so asking for it again hits nothing.
    for seed in range(100, 105):
        complete(server, prompt(seed, 4))
    mid = metrics(server)
    complete(server, hot)
    m = wait_for(
        server,
        lambda m: (
            value(m, "arc_evictor_block_queries_total")
            >= value(mid, "arc_evictor_block_queries_total") + 4
        ),
    )
    assert value(m, "arc_evictor_evictions_total", list="lru") > value(
        before, "arc_evictor_evictions_total", list="lru"
    )
    assert value(m, "vllm:prefix_cache_hits_total") == value(mid, "vllm:prefix_cache_hits_total")
    assert value(m, "arc_evictor_block_hits_total") == value(mid, "arc_evictor_block_hits_total")


def test_live_switch_under_load_then_arc_protects_a_reused_prefix(
    server: VllmServer, config_file: Path
) -> None:
    # Long generations (ignore_eos) keep the engine stepping; the switch happens at the first
    # step after a poll (every 100 ms here). Each worker goes on until the switch is seen, so
    # the load outlasts any scheduling delay (a fixed sleep before the write did not: on a
    # busy machine the load could end first, and an idle engine never polls).
    switched = threading.Event()
    busy = [False] * 6  # worker i has a request in flight

    def generate(worker: int) -> list[dict]:
        results = []
        while not results or not switched.is_set():
            busy[worker] = True
            results.append(complete(server, prompt(200 + worker, 2), 160))
            busy[worker] = False
        return results

    before = metrics(server)
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(generate, worker) for worker in range(6)]
        wait_for(
            server,
            lambda m: (
                value(m, "arc_evictor_block_queries_total")
                > value(before, "arc_evictor_block_queries_total")
            ),
        )
        config_file.write_text(json.dumps({"policy": "arc"}))
        m = wait_for(server, lambda m: value(m, "arc_evictor_policy_info", policy="arc") == 1)
        in_flight = sum(busy)
        switched.set()
        results = [result for future in futures for result in future.result(timeout=300)]
    assert in_flight >= 2, "the switch was not seen under load"
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    assert all(r["usage"]["completion_tokens"] == 160 for r in results)
    assert value(m, "arc_evictor_policy_info", policy="arc") == 1
    assert value(m, "arc_evictor_policy_info", policy="lru") == 0
    assert value(m, "arc_evictor_policy_switches_total") == 1

    # A fresh ARC (p = 0, no ghosts) for the protection check: the load above preempts and
    # recomputes requests, and the ghost hits that causes move p by amounts that depend on
    # timing, so p could let a scan reach T2. Switching away and back rebuilds the policy.
    for name, seed in (("lru", 600), ("arc", 601)):
        config_file.write_text(json.dumps({"policy": name}))
        # The plugin reads the file between scheduler steps once its poll interval has passed:
        # requests make steps, until the engine reports the switch.
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        while value(metrics(server), "arc_evictor_policy_info", policy=name) != 1:
            assert time.monotonic() < deadline, f"the engine did not switch to {name}"
            complete(server, prompt(seed, 1))
    assert value(metrics(server), "arc_evictor_policy_switches_total") == 3

    # Under ARC a prefix used twice moves to T2 and survives a one-time scan that LRU
    # would let evict it: the scan only replaces T1.
    hot = prompt(300, 3)
    complete(server, hot)
    complete(server, hot)
    for seed in range(400, 404):
        complete(server, prompt(seed, 4))
    before = metrics(server)
    complete(server, hot)
    m = wait_for(
        server,
        lambda m: (
            value(m, "arc_evictor_block_hits_total")
            >= value(before, "arc_evictor_block_hits_total") + 3
        ),
    )
    assert (
        value(m, "arc_evictor_block_hits_total") - value(before, "arc_evictor_block_hits_total")
        == 3
    )
    assert value(m, "arc_evictor_resident_blocks", list="t2") >= 3
    assert value(m, "arc_evictor_evictions_total", list="t1") > 0
    assert value(m, "arc_evictor_resident_blocks", list="lru") == 0


def test_malformed_policy_file_keeps_the_running_policy(
    server: VllmServer, config_file: Path
) -> None:
    config_file.write_text("{not json")
    # Requests make the steps between which the plugin reads the file, until it logs why it
    # kept the running policy.
    deadline = time.monotonic() + SWITCH_TIMEOUT_S
    while "not JSON" not in server.log_tail(400):
        assert time.monotonic() < deadline, "the plugin logged no error for the malformed file"
        complete(server, prompt(501, 1), max_tokens=4)
    complete(server, prompt(500, 1))
    m = metrics(server)
    assert value(m, "arc_evictor_policy_info", policy="arc") == 1
    config_file.write_text(json.dumps({"policy": "arc"}))


def test_unknown_policy_stops_start_up_naming_valid_policies(model_dir: Path) -> None:
    started = time.monotonic()
    bad = VllmServer(model_dir, num_gpu_blocks=NUM_BLOCKS, env={POLICY_ENV: "fifo"})
    with pytest.raises(VllmServerError, match="valid policies: lru"):
        bad.start()
    assert time.monotonic() - started < 120
