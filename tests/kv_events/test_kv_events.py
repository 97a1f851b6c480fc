"""The KV-cache events of a vLLM server with the plugin are exact under lru, arc and trio.

A router's kv_aware policy knows a replica's cache only from vLLM's KV-cache events, so with
the plugin deciding evictions the events must still say exactly what the replica caches.
One real server runs four phases of a document-QA workload (shared document prefixes under
Zipf popularity, a unique question per request; 18 document blocks and the questions stream
through 16 cacheable blocks, so every phase evicts), sent one request at a time: under lru,
then under arc after a live switch (docs/plugin.md, "Live switch"), then under trio after a
prefix-cache reset and a second switch; and last, still under trio, four requests at a time,
as a router's clients send them. The events are replayed as a router replays them (per hash, the
blocks stored minus those removed; emptied on ``AllBlocksCleared``) and compared with what
the server reports:

- each prompt sent alone finds in vLLM's prefix cache exactly the leading blocks the replay
  holds (``usage.prompt_tokens_details.cached_tokens``), and their sum is the plugin's hit
  count;
- every ``BlockRemoved`` hash is an eviction of the plugin and every eviction is published:
  their count is ``arc_evictor_evictions_total``;
- the replay's cached blocks number the plugin's ``arc_evictor_resident_blocks`` after each
  phase; at a live switch they are the blocks the policy held and kept, and the replay's
  hashes are those vLLM's own prefix-cache map holds (the switch log line);
- the reset is published once, as ``AllBlocksCleared``, and empties the server's cache.

The run takes about two minutes, most of it the server's start.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from arc_harness.vllm_server import VllmServer, write_policy_file
from tests.faults.serving import metric_sum
from tests.kv_events.conftest import BLOCK, FIRST_POLICY
from tests.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventStream,
    Received,
    Replay,
    block_chain,
    prompt_hashes,
    removed_then_restored,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """One phase: its policy (a different one than before means a live switch), whether the
    prefix cache is reset first, and whether its requests go four at a time."""

    name: str
    policy: str
    reset_first: bool = False
    concurrent: bool = False


PLAN = (
    PhasePlan("lru", FIRST_POLICY),
    PhasePlan("arc", "arc"),
    PhasePlan("trio", "trio", reset_first=True),
    PhasePlan("trio-concurrent", "trio", concurrent=True),
)
PHASES = [plan.name for plan in PLAN]
# One request per step: each request's hits are predicted from the events before its batch.
SEQUENTIAL = [plan.name for plan in PLAN if not plan.concurrent]
# A bound for a slow, busy machine on each wait below; every wait ends as soon as what it
# waits for is seen.
WAIT_S = 120.0
CONCURRENCY = 4
DOCUMENTS, DOCUMENT_BLOCKS = 6, 3
REQUESTS_PER_PHASE = 30
SWITCH_LINE = re.compile(
    r"policy switch (?P<old>\S+) -> (?P<new>\S+): (?P<kept>\d+) of (?P<before>\d+) "
    r"resident blocks kept; vLLM's prefix cache: (?P<tracked>\d+) of (?P<cached>\d+) cached "
    r"blocks resident"
)


@dataclass(frozen=True, slots=True)
class Sent:
    """One completion: its prompt, the tokens of its unique question block, vLLM's hits."""

    tokens: list[int]
    question: tuple[int, ...]
    cached_blocks: int


@dataclass(slots=True)
class Phase:
    """One phase of the run: where its events start, its requests, the plugin's readings."""

    plan: PhasePlan
    first_message: int  # index in the stream of the phase's first message
    sent: list[Sent] = field(default_factory=list)
    switch: dict[str, str] | None = None  # the switch log line's fields, when one ran
    reset_answer: dict | None = None  # POST /reset_prefix_cache, when the phase began with it
    evictions: float = 0.0  # arc_evictor_evictions_total (all lists) during the phase
    hits: float = 0.0  # arc_evictor_block_hits_total during the phase
    resident: float = 0.0  # arc_evictor_resident_blocks (all lists) at the end


@dataclass(slots=True)
class Observed:
    """What the events of one phase say, replayed from the start of the stream."""

    predicted: list[int] = field(default_factory=list)  # leading cached blocks per request
    removed: int = 0
    restored: int = 0
    cleared: int = 0
    blocks_before: int = 0  # cached blocks the replay holds before the phase's first message
    hashes_before: int = 0  # distinct hashes among them (what a request can hit)
    blocks_after: int = 0
    hashes_after: int = 0
    first_event_clears: bool = False


@dataclass(slots=True)
class Run:
    """The whole run: per phase what was sent and read, every message, the replay's verdicts."""

    phases: dict[str, Phase]
    messages: list[Received]
    observed: dict[str, Observed]
    anomalies: list[str]
    errors: list[str]


def documents() -> list[list[int]]:
    """The shared documents, the same in every phase: a switch meets blocks worth keeping."""
    rng = random.Random(7)
    return [
        [rng.randrange(4, 1024) for _ in range(DOCUMENT_BLOCKS * BLOCK)] for _ in range(DOCUMENTS)
    ]


def prompts(seed: int, docs: list[list[int]]) -> list[tuple[list[int], tuple[int, ...]]]:
    """(prompt, its first question block): a Zipf-popular document, 1-2 unique blocks, 1 token.

    The trailing token lets every full block be a hit (vLLM recomputes the last prompt token);
    the unique question block marks the request's own event batch.
    """
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(DOCUMENTS)]
    out = []
    for _ in range(REQUESTS_PER_PHASE):
        doc = rng.choices(docs, weights)[0]
        question = [rng.randrange(4, 1024) for _ in range(rng.randint(1, 2) * BLOCK + 1)]
        out.append((doc + question, tuple(question[:BLOCK])))
    return out


def complete(server: VllmServer, tokens: list[int]) -> int:
    """Send one completion; the number of its prompt blocks vLLM found cached."""
    response = requests.post(
        f"{server.base_url}/v1/completions",
        headers=server.auth_headers,
        json={"model": "tiny", "prompt": tokens, "max_tokens": 1, "ignore_eos": True},
        timeout=120,
    )
    response.raise_for_status()
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    assert cached % BLOCK == 0, f"{cached} cached tokens is not whole blocks"
    return cached // BLOCK


def stores_question(message: Received, question: tuple[int, ...]) -> bool:
    return any(
        isinstance(event, BlockStored)
        and any(
            tuple(event.token_ids[i : i + BLOCK]) == question
            for i in range(0, len(event.token_ids), BLOCK)
        )
        for event in message.batch.events
    )


def switch_line(server: VllmServer, new: str, timeout_s: float = WAIT_S) -> dict[str, str]:
    """The fields of the server log's switch line to policy ``new``."""
    assert server.log_path is not None
    deadline = time.monotonic() + timeout_s
    while True:
        for line in server.log_path.read_text(errors="replace").splitlines():
            match = SWITCH_LINE.search(line)
            if match and match["new"].split("-")[0] == new:
                return match.groupdict()
        if time.monotonic() > deadline:
            raise AssertionError(f"no switch line to {new} in the server log:\n{server.log_tail()}")
        time.sleep(0.1)


def run_phase(
    server: VllmServer, stream: EventStream, phase: Phase, seed: int, switched: bool
) -> None:
    """Send the phase's prompts, then wait for their events and the plugin's metrics."""
    queries_before = metric_sum(server, "arc_evictor_block_queries_total")
    evictions_before = metric_sum(server, "arc_evictor_evictions_total")
    hits_before = metric_sum(server, "arc_evictor_block_hits_total")
    planned = prompts(seed, documents())
    full_blocks = sum(len(tokens) // BLOCK for tokens, _ in planned)
    if phase.plan.concurrent:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            found = list(pool.map(lambda prompt: complete(server, prompt[0]), planned))
    else:
        found = [complete(server, tokens) for tokens, _ in planned]
    phase.sent = [Sent(t, q, cached) for (t, q), cached in zip(planned, found, strict=True)]
    if switched:
        # The first request of the phase triggered the switch; its line is in the log.
        phase.switch = switch_line(server, phase.plan.policy)
    # Every request stores its unique question block in one batch: the events are all in.
    stream.wait_for(
        lambda messages: all(
            any(stores_question(m, s.question) for m in messages[phase.first_message :])
            for s in phase.sent
        ),
        timeout_s=WAIT_S,
    )
    # The plugin publishes a step's counts at the next step; vLLM runs one after the last
    # request finishes. The query count (full prompt blocks) shows that step has run.
    deadline = time.monotonic() + WAIT_S
    while (
        metric_sum(server, "arc_evictor_block_queries_total") < queries_before + full_blocks
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    phase.evictions = metric_sum(server, "arc_evictor_evictions_total") - evictions_before
    phase.hits = metric_sum(server, "arc_evictor_block_hits_total") - hits_before
    phase.resident = metric_sum(server, "arc_evictor_resident_blocks")


def cached_prefix(tokens: list[int], chain: dict, state: Replay) -> int:
    """The prompt's leading blocks that ``state`` holds: what vLLM's lookup would hit."""
    hashes = prompt_hashes(tokens, BLOCK, chain)
    leading = 0
    while leading < len(hashes) and hashes[leading] in state.count:
        leading += 1
    return leading


def replay(
    run_phases: dict[str, Phase], messages: list[Received]
) -> tuple[dict[str, Observed], list[str]]:
    """Replay the whole stream once, predicting each request's hits from the events before
    its own batch (one request per step: a sequential workload)."""
    chain = block_chain(m.batch for m in messages)
    state = Replay()
    observed: dict[str, Observed] = {}
    phases = list(run_phases.values())
    for index, phase in enumerate(phases):
        end = phases[index + 1].first_message if index + 1 < len(phases) else len(messages)
        seen = Observed(blocks_before=state.blocks, hashes_before=len(state.resident))
        own_batch = (
            {}
            if phase.plan.concurrent
            else {
                next(
                    (
                        i
                        for i in range(phase.first_message, end)
                        if stores_question(messages[i], s.question)
                    ),
                    -1,
                ): s
                for s in phase.sent
            }
        )
        for i in range(phase.first_message, end):
            batch = messages[i].batch
            if i == phase.first_message and batch.events:
                seen.first_event_clears = isinstance(batch.events[0], AllBlocksCleared)
            seen.restored += removed_then_restored(batch)
            # A reset is queued before the step that publishes it: it precedes the lookup.
            lookup_at = 0
            while lookup_at < len(batch.events) and isinstance(
                batch.events[lookup_at], AllBlocksCleared
            ):
                lookup_at += 1
            sent = own_batch.get(i)
            for position, event in enumerate(batch.events):
                if position == lookup_at and sent is not None:
                    seen.predicted.append(cached_prefix(sent.tokens, chain, state))
                if isinstance(event, BlockRemoved):
                    seen.removed += len(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    seen.cleared += 1
                state.apply(event)
        seen.blocks_after, seen.hashes_after = state.blocks, len(state.resident)
        observed[phase.plan.name] = seen
    return observed, state.anomalies


@pytest.fixture(scope="module")
def run(server: VllmServer, event_stream: EventStream, policy_file: Path) -> Run:
    started = time.monotonic()
    phases: dict[str, Phase] = {}
    policy = FIRST_POLICY
    for seed, plan in enumerate(PLAN):
        phase = Phase(plan, first_message=len(event_stream.received))
        if plan.reset_first:
            answer = requests.post(
                f"{server.base_url}/reset_prefix_cache", headers=server.auth_headers, timeout=30
            )
            answer.raise_for_status()
            phase.reset_answer = answer.json()
        switched = plan.policy != policy
        if switched:
            write_policy_file(policy_file, plan.policy)
            policy = plan.policy
        run_phase(server, event_stream, phase, seed, switched)
        phases[plan.name] = phase
    messages = event_stream.received
    observed, anomalies = replay(phases, messages)
    print(
        f"{len(PLAN)} phases of {REQUESTS_PER_PHASE} requests in {time.monotonic() - started:.1f} s"
    )
    for name, seen in observed.items():
        phase = phases[name]
        print(
            f"{name}: {phase.evictions:.0f} evictions, {seen.removed} BlockRemoved "
            f"({seen.restored} stored again in the same step), "
            f"{sum(s.cached_blocks for s in phase.sent)} hit blocks, {seen.blocks_after} cached "
            f"blocks holding {seen.hashes_after} hashes"
        )
    return Run(phases, messages, observed, anomalies, list(event_stream.errors))


def test_the_stream_is_complete_and_decodes(run: Run) -> None:
    assert run.errors == []
    assert [m.seq for m in run.messages] == list(range(len(run.messages)))
    assert {m.topic for m in run.messages} == {b""}


def test_the_events_never_remove_a_hash_no_cached_block_holds(run: Run) -> None:
    assert run.anomalies == []


@pytest.mark.parametrize("name", SEQUENTIAL)
def test_each_prompt_hits_exactly_the_blocks_the_events_say_are_cached(run: Run, name: str) -> None:
    phase, seen = run.phases[name], run.observed[name]
    assert seen.predicted == [s.cached_blocks for s in phase.sent]
    assert sum(s.cached_blocks for s in phase.sent) == phase.hits
    assert phase.hits > 0


@pytest.mark.parametrize("name", PHASES)
def test_block_removed_events_are_the_plugin_evictions(run: Run, name: str) -> None:
    phase, seen = run.phases[name], run.observed[name]
    assert phase.evictions > 0, "the workload must evict"
    assert seen.removed == phase.evictions, (
        f"{seen.restored} of the {seen.removed} removed hashes were stored again in the same step"
    )


@pytest.mark.parametrize("name", PHASES)
def test_the_replayed_cache_is_the_plugin_resident_blocks(run: Run, name: str) -> None:
    assert run.observed[name].blocks_after == run.phases[name].resident


def test_a_live_switch_keeps_every_block_the_events_say_is_cached(run: Run) -> None:
    switch = run.phases["arc"].switch
    assert switch is not None and switch["old"] == FIRST_POLICY
    seen = run.observed["arc"]
    assert seen.blocks_before > 0
    # Resident blocks (copies of a hash included) before the switch and kept by it; then the
    # hashes vLLM's own prefix-cache map holds, and those the new policy holds.
    assert [int(switch["before"]), int(switch["kept"])] == [seen.blocks_before] * 2
    assert [int(switch["cached"]), int(switch["tracked"])] == [seen.hashes_before] * 2


def test_a_prefix_cache_reset_is_published_once_as_all_blocks_cleared(run: Run) -> None:
    phase, seen = run.phases["trio"], run.observed["trio"]
    assert phase.reset_answer == {"success": True}
    assert run.observed["arc"].blocks_after > 0, "the reset must have had blocks to clear"
    assert sum(o.cleared for o in run.observed.values()) == seen.cleared == 1
    assert seen.first_event_clears
    # The switch ran after the reset: the policy and vLLM's prefix-cache map were empty.
    assert phase.switch is not None
    assert [int(phase.switch[k]) for k in ("kept", "before", "tracked", "cached")] == [0] * 4
    assert phase.sent[0].cached_blocks == seen.predicted[0] == 0
