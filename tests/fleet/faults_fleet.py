"""Helpers of the fleet fault tests: prompts, router metric readings, a Locust replay in the
background, and a reader of a vLLM server's KV-event replay endpoint.

Everything here talks to the real components of an ``arc_harness.fleet.Fleet``
(docs/architecture.md, "Routing"): the vLLM router's Prometheus page, the servers' ZMQ replay
sockets, the real Locust.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from arc_harness.fleet import BLOCK_TOKENS, Fleet, FleetRouter
from arc_loadtest.run import ReplayRun, run_replay
from arc_serving_common.traces import write_trace
from arc_simulator.generate import DocQAParams, docqa, to_records
from tests.replay_budget import replay_run_time_s

# The tiny model's ids 0..3 are special tokens; ordinary words run up to its vocabulary size.
FIRST_WORD_ID, VOCABULARY = 4, 1024
# vLLM's replay socket ends every answer with this sequence number (ZmqEventPublisher.END_SEQ).
END_SEQ = -1


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """``blocks`` whole blocks of seed-drawn token ids, plus one token (the part never cached)."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, VOCABULARY) for _ in range(blocks * BLOCK_TOKENS + 1)]


def variant(tokens: list[int], tag: int) -> list[int]:
    """The same cached blocks with another last token: a new request for the same prefix."""
    return [*tokens[:-1], FIRST_WORD_ID + tag % (VOCABULARY - FIRST_WORD_ID)]


def router_total(router: FleetRouter, name: str, **labels: str) -> float:
    """The sum of the router's samples ``name`` whose labels include ``labels``."""
    samples = router.metrics().get(name, [])
    return sum(value for found, value in samples if labels.items() <= found.items())


def worker_requests(fleet: Fleet) -> list[float]:
    """Requests each server answered so far (vLLM's ``vllm:request_success_total``)."""
    counts = []
    for stats in fleet.per_replica_stats():
        assert stats.requests is not None, f"server {stats.index} ({stats.url}) does not answer"
        counts.append(stats.requests)
    return counts


def docqa_trace(
    path: Path, *, requests: int, spacing_s: float, output_tokens: int, seed: int = 0
) -> Path:
    """A document-QA trace (Bailian form): four documents of eight blocks asked in turn under
    Zipf popularity, ``requests`` questions ``spacing_s`` apart (a steady open-loop load)."""
    params = DocQAParams(
        documents=4,
        document_tokens=8 * BLOCK_TOKENS,
        questions_per_document=requests / 4,
        question_tokens=16,
        output_tokens=output_tokens,
        seed=seed,
    )
    records = list(to_records(docqa(params), "bailian", BLOCK_TOKENS))[:requests]
    if len(records) < requests:
        raise ValueError(f"the generator gave {len(records)} requests, {requests} were asked")
    for number, record in enumerate(records):
        record["timestamp"] = round(spacing_s * number, 3)
    write_trace(path, records)
    return path


class BackgroundReplay:
    """The real Locust replay of a trace through the fleet's router, in a thread.

    Invariant: ``run`` is set once the thread has finished (``join`` returns it).
    """

    def __init__(self, fleet: Fleet, trace: Path, out_dir: Path, model_dir: Path) -> None:
        self.run: ReplayRun | None = None
        # The replay's own bound, derived from the trace (it ends with its last answer).
        self.run_time_s = replay_run_time_s(trace, block_tokens=BLOCK_TOKENS)
        self._thread = threading.Thread(
            target=self._replay, args=(fleet, trace, out_dir, model_dir), daemon=True
        )

    def _replay(self, fleet: Fleet, trace: Path, out_dir: Path, model_dir: Path) -> None:
        self.run = run_replay(fleet.router.url, trace, out_dir=out_dir, run_time_s=self.run_time_s,
                              api_key=fleet.api_key, block_tokens=BLOCK_TOKENS,
                              tokenizer=model_dir)  # fmt: skip

    def start(self) -> BackgroundReplay:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> ReplayRun:
        """The replay's result, once it has ended (within its run-time and a minute)."""
        timeout_s = self.run_time_s + 60
        self._thread.join(timeout=timeout_s)
        assert not self._thread.is_alive(), f"the replay still runs after {timeout_s:.0f} s"
        assert self.run is not None, "the replay thread ended without a result"
        return self.run


def result_rows(run: ReplayRun) -> list[dict[str, Any]]:
    """The replay's per-request rows (arc_loadtest's results JSONL)."""
    return [json.loads(line) for line in run.results.read_text().splitlines()]


@dataclass(frozen=True, slots=True)
class ReplayedStore:
    """One ``BlockStored`` event a publisher's replay buffer still holds."""

    seq: int
    token_ids: tuple[int, ...]


def replayed_stores(port: int, *, timeout_s: float = 60.0) -> list[ReplayedStore]:
    """Every ``BlockStored`` event that a vLLM server's replay endpoint sends from seq 0."""
    return [
        ReplayedStore(seq, tuple(event["token_ids"]))
        for seq, event in replayed_events(port, timeout_s=timeout_s)
        if event.get("type") == "BlockStored"
    ]


def replayed_events(port: int, *, timeout_s: float = 60.0) -> list[tuple[int, dict[str, Any]]]:
    """Every event (with its batch's sequence number) that a vLLM server's replay endpoint
    sends from seq 0: what its publisher has sent so far, in order.

    Speaks vLLM's replay protocol (``ZmqEventPublisher._service_replay``): a DEALER sends an
    empty frame and the start sequence number (8 bytes, big-endian); the publisher answers
    ``[empty, topic, seq, payload]`` per buffered batch and ends with seq -1.
    """
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, round(timeout_s * 1000))
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        found: list[tuple[int, dict[str, Any]]] = []
        while True:
            try:
                frames = dealer.recv_multipart()
            except zmq.Again as error:
                raise AssertionError(
                    f"the replay endpoint on port {port} sent no end marker in {timeout_s} s"
                ) from error
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == END_SEQ:
                return found
            # EventBatch is an array [ts, events, dp_rank]; each event a tagged map.
            _, events, *_ = msgspec.msgpack.decode(frames[-1])
            found += [(seq, event) for event in events if isinstance(event, dict)]
    finally:
        dealer.close()


@dataclass(frozen=True, slots=True)
class WorkerSource:
    """The parts of a fleet server a ``FleetRouter`` reads: its URL and its event ports."""

    url: str
    kv_event_port: int
    kv_replay_port: int


def sources_with_silent(fleet: Fleet, index: int, silent_port: int) -> list[WorkerSource]:
    """The fleet's workers, with server ``index``'s event and replay sources moved to
    ``silent_port`` and the next port, where nothing publishes.

    To the router this is what a blocked or misconfigured publisher port looks like: ZMQ
    connects lazily and retries quietly, so the worker stays in the pool and no event arrives.
    """
    return [
        WorkerSource(server.url, silent_port, silent_port + 1)
        if server.index == index
        else WorkerSource(server.url, server.kv_event_port, server.kv_replay_port)
        for server in fleet.servers
    ]
