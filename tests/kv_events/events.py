"""vLLM's KV-cache event stream as a consumer (the vLLM router's kv_aware policy) reads it.

vLLM's ZMQ publisher (``vllm/distributed/kv_events.py``) sends one multipart message per
scheduler step that changed the prefix cache: ``[topic, sequence number (8 bytes, big
endian), msgpack payload]``. The payload is an ``EventBatch`` encoded as an array
``[ts, events, data_parallel_rank]``; each event is a map tagged by ``type``: ``BlockStored``
(hashes of blocks that entered vLLM's prefix-cache map, the parent hash and their tokens),
``BlockRemoved`` (hashes of blocks that left it) or ``AllBlocksCleared`` (a prefix-cache
reset). The structs below declare only the fields a cache tracker needs; msgspec skips the
others, as the router's decoder does.

``Replay`` rebuilds what a replica caches from the stream alone, the way a router must.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

# vLLM publishes 64-bit integer hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES),
# the raw digest bytes otherwise.
BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Received:
    """One published message: its topic, sequence number and decoded batch."""

    topic: bytes
    seq: int
    batch: EventBatch


class EventStream:
    """A SUB socket bound on 127.0.0.1 that vLLM's publisher connects to; a thread collects.

    Binding here (vLLM connects when its endpoint has no ``*``) gives a free port without a
    race and keeps the stream off other interfaces. Invariant: ``received`` holds every
    message in arrival order, and ``errors`` every message that did not decode.
    """

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.bind("tcp://127.0.0.1:*")
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self._lock = threading.Lock()
        self._received: list[Received] = []
        self.errors: list[str] = []
        self._running = True
        self._thread = threading.Thread(target=self._collect, name="kv-events", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while self._running:
            try:
                topic, seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            except ValueError as exc:  # not three frames
                self.errors.append(f"malformed message: {exc}")
                continue
            try:
                batch = self._decoder.decode(payload)
            except msgspec.DecodeError as exc:
                self.errors.append(f"batch {int.from_bytes(seq, 'big')}: {exc}")
                continue
            with self._lock:
                self._received.append(Received(topic, int.from_bytes(seq, "big"), batch))

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def wait_for(
        self, done: Callable[[list[Received]], bool], timeout_s: float = 30.0
    ) -> list[Received]:
        """The messages once ``done(messages)`` holds, or when ``timeout_s`` ran out."""
        deadline = time.monotonic() + timeout_s
        while True:
            received = self.received
            if done(received) or time.monotonic() > deadline:
                return received
            time.sleep(0.05)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()


class Replay:
    """Per block hash, the number of cached blocks the events say hold it.

    A ``BlockStored`` hash adds one, a ``BlockRemoved`` hash takes one away (vLLM emits one
    event per block it puts into or takes out of its prefix-cache map, so two copies of a
    hash take two removals), ``AllBlocksCleared`` empties the table. Invariant: ``anomalies``
    names every removal of a hash that no cached block holds.
    """

    def __init__(self) -> None:
        self.count: dict[BlockHash, int] = {}
        self.anomalies: list[str] = []

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                self.count[block_hash] = self.count.get(block_hash, 0) + 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                left = self.count.get(block_hash, 0) - 1
                if left < 0:
                    self.anomalies.append(f"hash {block_hash} removed but not cached")
                if left > 0:
                    self.count[block_hash] = left
                else:
                    self.count.pop(block_hash, None)
        else:
            self.count.clear()

    @property
    def resident(self) -> set[BlockHash]:
        """The hashes a request can hit."""
        return set(self.count)

    @property
    def blocks(self) -> int:
        """The cached blocks, further copies of a hash included."""
        return sum(self.count.values())


def block_chain(
    batches: Iterable[EventBatch],
) -> dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash]:
    """(parent hash, a block's tokens) -> the block's hash, from every ``BlockStored`` seen.

    vLLM chains a block's hash to its parent's, so this map walks a prompt block by block.
    """
    chain: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash] = {}
    for batch in batches:
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            parent, size = event.parent_block_hash, event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                chain[(parent, tuple(event.token_ids[i * size : (i + 1) * size]))] = block_hash
                parent = block_hash
    return chain


def prompt_hashes(
    tokens: Sequence[int],
    block_size: int,
    chain: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash],
) -> list[BlockHash]:
    """The hashes of the prompt's leading full blocks that the events ever stored."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block_hash = chain.get((parent, tuple(tokens[start : start + block_size])))
        if block_hash is None:
            break
        hashes.append(block_hash)
        parent = block_hash
    return hashes


def removed_then_restored(batch: EventBatch) -> int:
    """Removals in ``batch`` of a hash that a later ``BlockStored`` of the same batch stores.

    Such a pair is either an eviction followed by a recomputation of the same block, or a
    block that left vLLM's map without being evicted (a pool handing a free cached copy back
    to the request asking for it); the count tells the two apart when the eviction count
    and the removals differ.
    """
    pairs = 0
    removed: list[BlockHash] = []
    for event in batch.events:
        if isinstance(event, BlockRemoved):
            removed.extend(event.block_hashes)
        elif isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                if block_hash in removed:
                    removed.remove(block_hash)
                    pairs += 1
    return pairs
