"""Switch the eviction policy live, again and again, during a Locust replay on the real vLLM.

A thread rewrites the policy file (as a ConfigMap update does: a new file swapped in) through
every policy while the replay runs: switch n once the engine has applied the one before and
answered n times ``ANSWERS_PER_SWITCH`` requests of the replay. Shown: no request
fails, the engine applies every switch written (its log and the switch counter), and no
resident block is lost at any switch (the plugin logs, per switch, the resident blocks
before it and how many of them the new policy holds, and the blocks vLLM's own prefix-cache
map holds and how many of those the new policy holds); after the switches, a prompt of the
replay sent again still hits the cache.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from itertools import cycle, islice
from pathlib import Path

import pytest
import requests

from arc_harness.vllm_server import VllmServer, write_policy_file
from arc_loadtest.run import run_replay
from arc_loadtest.stream import completion_body
from arc_loadtest.tokens import TokenMapper, vocabulary_from_tokenizer
from arc_serving_common.names import CONFIG_ENV, POLL_MS_ENV
from arc_serving_common.traces import read_trace
from tests.faults.serving import BLOCK_TOKENS, docqa_trace, metric_sum
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow]

# 80 requests 0.5 s apart: a 40 s replay. Ten switches spread over it by its answers, at
# whatever speed the machine serves them: switch n is written after 6n answers, so the engine
# is busy (and polls the file) at each one, and only once the one before was applied, so no
# write is coalesced with the next. The last is written after 60 answers: the 20 left give
# the engine time to apply it.
TRACE_REQUESTS, SPACING_S = 80, 0.5
SWITCHES, ANSWERS_PER_SWITCH = 10, 6
# A bound for a slow, busy machine on the engine's applying a switch while requests arrive.
APPLY_TIMEOUT_S = 120.0
FIRST_POLICY = "lru"
CYCLE = ["arc", "s3fifo", "sieve", "dbl", "trio", "lru"]
SWITCH_LINE = re.compile(
    r"policy switch (?P<old>\S+) -> (?P<new>\S+): (?P<kept>\d+) of (?P<before>\d+) "
    r"resident blocks kept; vLLM's prefix cache: (?P<tracked>\d+) of (?P<cached>\d+) cached "
    r"blocks resident"
)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("switch-config") / "policy.json"
    path.write_text(json.dumps({"policy": FIRST_POLICY}))
    return path


@pytest.fixture(scope="module")
def server(
    model_dir: Path, policy_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("switch-vllm") / "vllm.log"
    env = {CONFIG_ENV: str(policy_file), POLL_MS_ENV: "100"}
    # 64 cacheable blocks (+ the null block): the trace's documents do not all fit.
    with VllmServer(
        model_dir, block_size=BLOCK_TOKENS, num_gpu_blocks=65, env=env, log_path=log
    ) as srv:
        yield srv


def switcher(server: VllmServer, path: Path, written: list[str], stop: threading.Event) -> None:
    """Write switch ``n`` (from 1) once the engine has answered ``n`` times ANSWERS_PER_SWITCH
    requests of the replay and applied switch ``n - 1`` (its switch counter), SWITCHES
    times; stop early when ``stop`` is set (the replay ended)."""
    switched = metric_sum(server, "arc_evictor_policy_switches_total")
    answered = metric_sum(server, "vllm:request_success_total")
    for number, policy in enumerate(islice(cycle(CYCLE), SWITCHES), start=1):
        deadline = time.monotonic() + APPLY_TIMEOUT_S
        while metric_sum(server, "arc_evictor_policy_switches_total") < switched + len(written):
            if stop.wait(0.1) or time.monotonic() > deadline:
                return
        while (
            metric_sum(server, "vllm:request_success_total")
            < answered + number * ANSWERS_PER_SWITCH
        ):
            if stop.wait(0.1):
                return
        write_policy_file(path, policy)
        written.append(policy)


def test_live_switches_lose_no_request_and_no_block(
    server: VllmServer, policy_file: Path, model_dir: Path, tmp_path: Path
) -> None:
    trace = docqa_trace(tmp_path / "trace.jsonl", count=TRACE_REQUESTS, spacing_s=SPACING_S)
    switches_before = metric_sum(server, "arc_evictor_policy_switches_total")
    written: list[str] = []
    stop = threading.Event()
    writer = threading.Thread(
        target=switcher, args=(server, policy_file, written, stop), daemon=True
    )
    writer.start()
    try:
        run = run_replay(server.base_url, trace, out_dir=tmp_path / "out",
                         run_time_s=replay_run_time_s(trace, block_tokens=BLOCK_TOKENS),
                         api_key=server.api_key, block_tokens=BLOCK_TOKENS,
                         tokenizer=model_dir)  # fmt: skip
    finally:
        stop.set()
        writer.join(timeout=30)

    # Every request answered.
    assert run.exit_code == 0, run.log[-3000:]
    summary = run.summary
    assert summary is not None
    assert (summary["requests_ok"], summary["requests_failed"], summary["requests_unsent"]) == (
        TRACE_REQUESTS,
        0,
        0,
    )
    # Every switch written was applied, in order, once.
    assert len(written) == SWITCHES, f"only {len(written)} switches written during the replay"
    applied = metric_sum(server, "arc_evictor_policy_switches_total") - switches_before
    assert applied == SWITCHES
    lines = [m.groupdict() for m in SWITCH_LINE.finditer(server.log_tail(100_000))]
    assert [line["new"].split("-")[0] for line in lines] == written
    assert lines[0]["old"].split("-")[0] == FIRST_POLICY
    # No resident block lost: each switch kept every block that was resident before it, and,
    # counted in vLLM's own prefix-cache map (what a request can hit), every block vLLM
    # caches is resident in the new policy and none resident is missing from vLLM's map.
    for line in lines:
        assert int(line["kept"]) == int(line["before"]), line
        assert int(line["tracked"]) == int(line["cached"]) == int(line["before"]), line
    assert all(int(line["cached"]) > 0 for line in lines)  # there was something to lose
    # The engine reports the last policy written as the active one.
    metrics = requests.get(f"{server.base_url}/metrics", timeout=10, headers=server.auth_headers)
    assert f'arc_evictor_policy_info{{policy="{written[-1]}"}} 1.0' in metrics.text
    # The cache still serves hits after the switches: the trace's last prompt, sent again
    # (same tokens: the load test's mapping, seed and vocabulary), hits every full block but
    # the one holding its last token (vLLM computes that one anyway).
    last = list(read_trace(trace, block_tokens=BLOCK_TOKENS))[-1]
    mapper = TokenMapper(vocabulary_from_tokenizer(model_dir), seed=0, block_tokens=BLOCK_TOKENS)
    prompt = mapper.prompt(last.hash_ids, last.input_length)
    hits_before = metric_sum(server, "vllm:prefix_cache_hits_total")
    body = completion_body(server.served_model_name, prompt, 1) | {"stream": False}
    del body["stream_options"]
    answer = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=120,
                           headers=server.auth_headers)  # fmt: skip
    assert answer.status_code == 200, answer.text
    hit_tokens = metric_sum(server, "vllm:prefix_cache_hits_total") - hits_before
    assert hit_tokens >= (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > 0, hit_tokens
    print(
        f"live switch: {len(written)} switches written, {int(applied)} applied; "
        f"{summary['requests_ok']} requests ok, {summary['requests_failed']} failed; "
        f"resident blocks kept per switch: {[int(line['before']) for line in lines]}; "
        f"the last prompt re-sent hit {int(hit_tokens)} of {len(prompt)} tokens"
    )
