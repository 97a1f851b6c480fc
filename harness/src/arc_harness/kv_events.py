"""Record what vLLM servers publish on their KV-event ZMQ sockets, as a router receives it.

``KvEventRecorder`` subscribes to each server's publisher (a SUB socket on the endpoint the
router subscribes to, every topic) from a thread and keeps every batch with the wall time vLLM
stamped it and the wall time it arrived: ``KvBatch`` (server index, both times, sequence
number, events). vLLM's publisher sends
``[topic, sequence number (8 bytes, big endian), payload]``; the payload is a msgpack
``EventBatch`` ``[ts, [event, ...], data_parallel_rank]`` (``ts``: the scheduler's
``time.time()`` when it took the step's events, the same clock on one machine), each event a
map tagged by its
``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ...),
``BlockRemoved`` (``block_hashes``) or ``AllBlocksCleared``. Hashes are 64-bit integers by
default (raw digests otherwise) and are kept here as strings.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any


@dataclass(frozen=True, slots=True)
class KvEvent:
    """One event: ``kind`` is BlockStored, BlockRemoved or AllBlocksCleared."""

    kind: str
    block_hashes: tuple[str, ...] = ()
    parent: str | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One published batch: server index, the wall time vLLM stamped it (``published``) and
    the one it arrived here (``received``; a subscriber in a busy process can take a second
    longer than the router does), sequence number, events."""

    server: int
    published: float
    received: float
    seq: int
    events: tuple[KvEvent, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "published": self.published,
            "received": self.received,
            "seq": self.seq,
            "events": [
                {
                    "kind": event.kind,
                    "block_hashes": list(event.block_hashes),
                    "parent": event.parent,
                    "token_ids": list(event.token_ids),
                }
                for event in self.events
            ],
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> KvBatch:
        return cls(
            row["server"],
            row["published"],
            row["received"],
            row["seq"],
            tuple(
                KvEvent(
                    event["kind"],
                    tuple(event["block_hashes"]),
                    event["parent"],
                    tuple(event["token_ids"]),
                )
                for event in row["events"]
            ),
        )


def write_batches(path: Path, batches: Sequence[KvBatch]) -> None:
    """One JSON line per batch."""
    with path.open("w") as out:
        for batch in batches:
            out.write(json.dumps(batch.as_json()) + "\n")


def read_batches(path: Path) -> list[KvBatch]:
    return [KvBatch.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


def _name(value: Any) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


def decode_event(raw: dict[str, Any]) -> KvEvent:
    """One msgpack-decoded vLLM event (a map tagged by ``type``) as a ``KvEvent``."""
    kind = raw["type"]
    hashes = tuple(_name(h) for h in raw.get("block_hashes") or ())
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        return KvEvent(
            kind, hashes, None if parent is None else _name(parent), tuple(raw["token_ids"])
        )
    return KvEvent(kind, hashes)


def decode_batch(server: int, received: float, seq: int, payload: bytes) -> KvBatch:
    """A published message's payload as a ``KvBatch``."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    events = tuple(decode_event(raw) for raw in batch[1])
    return KvBatch(server, float(batch[0]), received, seq, events)


class KvEventRecorder:
    """``with KvEventRecorder(endpoints) as recorder:`` keeps every batch each endpoint (one
    per server, in server order) publishes meanwhile; ``snapshot()`` returns them.

    Invariant: the batches only grow while the recorder runs; its threads stop on exit.
    Entering returns once every subscription is in place.
    """

    POLL_MS = 20
    SUBSCRIBE_S = 0.3  # a ZMQ subscription reaches the publisher a moment after connect
    DRAIN_S = 0.5  # vLLM publishes a step's events after the step: wait for the last ones

    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self._batches: list[KvBatch] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Barrier(len(self.endpoints) + 1)

    def _listen(self, server: int, endpoint: str) -> None:
        import zmq

        socket = zmq.Context.instance().socket(zmq.SUB)
        try:
            try:
                socket.connect(endpoint)
                socket.setsockopt(zmq.SUBSCRIBE, b"")
            except zmq.ZMQError:
                self._ready.abort()  # the recorder's start fails instead of waiting
                raise
            self._ready.wait()
            while not self._stop.is_set():
                if not socket.poll(self.POLL_MS):
                    continue
                _topic, seq, payload = socket.recv_multipart()
                batch = decode_batch(server, time.time(), int.from_bytes(seq, "big"), payload)
                with self._lock:
                    self._batches.append(batch)
        finally:
            socket.close(linger=0)

    def __enter__(self) -> KvEventRecorder:
        for server, endpoint in enumerate(self.endpoints):
            thread = threading.Thread(
                target=self._listen, args=(server, endpoint), name=f"kv-events-{server}",
                daemon=True,
            )  # fmt: skip
            thread.start()
            self._threads.append(thread)
        try:
            self._ready.wait(timeout=10)
        except threading.BrokenBarrierError as exc:
            self._stop.set()
            raise RuntimeError(f"could not subscribe to {self.endpoints}") from exc
        time.sleep(self.SUBSCRIBE_S)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        time.sleep(self.DRAIN_S)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def snapshot(self) -> list[KvBatch]:
        with self._lock:
            return list(self._batches)
