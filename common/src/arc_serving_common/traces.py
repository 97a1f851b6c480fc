"""Trace readers and writers: one lazy reader per format, auto-detected.

Two public forms (docs/architecture.md, "Traces"), one JSON object per line:

- Mooncake: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``;
  512 tokens per hash id, and ids are already prefix (chain) hashes, so they are
  the prefix-cache keys as they stand.
- Qwen-Bailian: ``{"chat_id", "parent_chat_id" (-1 for a root), "timestamp": s,
  "input_length", "output_length", "type", "turn", "hash_ids"}``; 16 tokens per
  id, and ids hash one block's content only. Two requests that share block id 7
  at position 3 share a cached block only if their first three blocks agree too,
  so each id is re-keyed by chain: the key of block i stands for (key of block
  i-1, id i), interned to a small int in first-seen order.

A malformed line raises ``TraceError`` naming the file, the line and the problem;
nothing is yielded past it, so a caller that reads the whole trace before acting
(``load_trace``) changes nothing on bad input. Lines are split at ``\n`` only (a
``\r\n`` ending is fine) and decoded as UTF-8 one at a time, so a bad byte is
reported on its own line; a UTF-8 byte-order mark opening the file is skipped. A key
given twice in one object is an error (JSON leaves its meaning open), and integers
must fit JSON's exact range (``MAX_INT``; hash ids: 64 bits).
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from arc_serving_common.jsonutil import loads_unique

TraceFormatName = Literal["mooncake", "bailian"]
FORMATS: tuple[TraceFormatName, ...] = ("mooncake", "bailian")
BLOCK_TOKENS: dict[TraceFormatName, int] = {"mooncake": 512, "bailian": 16}
# Largest integer field value: beyond 2**53 JSON numbers stop being exact in most readers,
# and lengths that large overflow the float arithmetic of the cost model.
MAX_INT = 2**53 - 1
MAX_HASH_ID = 2**64 - 1  # hash ids are 64-bit hashes at most
# Keys only the Qwen-Bailian form has: a line with any of them is read as Bailian, so a
# Bailian line missing chat_id is reported as such instead of passing as Mooncake.
BAILIAN_KEYS = frozenset({"chat_id", "parent_chat_id", "turn", "type"})
_JSON_BLANK = " \t\r\n"  # JSON's whitespace; a line of only these is skipped


class TraceError(ValueError):
    """A trace that cannot be read: names the file, the line and what is wrong."""

    def __init__(self, path: str | Path, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.line = line
        self.problem = problem


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``hash_ids`` are the ids as the file has them, one per block including a
    partial last block (they seed the load test's token ids). ``keys`` are the
    prefix-cache keys (chain keys) of the full blocks only: like vLLM, a partial
    block is never cached.
    """

    index: int
    line: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    keys: tuple[int, ...]
    block_tokens: int
    chat_id: int | None = None  # Bailian: this request's id; parent_id links the previous turn
    parent_id: int | None = None
    turn: int | None = None
    kind: str | None = None

    @property
    def num_blocks(self) -> int:
        """Cacheable (full) blocks."""
        return len(self.keys)

    @property
    def max_hit_blocks(self) -> int:
        """Blocks that can be hits: vLLM always computes the prompt's last token."""
        return min(len(self.keys), (self.input_length - 1) // self.block_tokens)


def detect_format(record: dict[str, Any]) -> TraceFormatName | None:
    """The form one parsed line is written in, or None if it is neither."""
    if not BAILIAN_KEYS.isdisjoint(record):
        return "bailian"
    if "hash_ids" in record:
        return "mooncake"
    return None


def _load_line(data: bytes) -> Any:
    """One line's JSON value; ValueError names what is wrong with it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not UTF-8 text ({error.reason} at byte {error.start + 1})") from None
    try:
        return loads_unique(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    # Other ValueErrors (a duplicate key, an integer past Python's digit limit) pass as they are.


def _field_int(record: dict[str, Any], name: str, minimum: int) -> int:
    value = record.get(name)
    if name not in record:
        raise ValueError(f"missing field {name!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"field {name!r} must be >= {minimum}, got {value}")
    if value > MAX_INT:
        raise ValueError(f"field {name!r} must be <= {MAX_INT}, got {value}")
    return value


def _field_number(record: dict[str, Any], name: str) -> float:
    if name not in record:
        raise ValueError(f"missing field {name!r}")
    value = record[name]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ValueError(f"field {name!r} must be at most {MAX_INT} in size, got {value}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"field {name!r} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"field {name!r} must be >= 0, got {value}")
    return float(value)


def _hash_ids(record: dict[str, Any], input_length: int, block_tokens: int) -> tuple[int, ...]:
    if "hash_ids" not in record:
        raise ValueError("missing field 'hash_ids'")
    ids = record["hash_ids"]
    # Checked with C-level passes (types, then bounds): this runs on every block of a trace.
    if not isinstance(ids, list) or (
        ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > MAX_HASH_ID)
    ):
        raise ValueError(
            f"field 'hash_ids' must be a list of integers in [0, {MAX_HASH_ID}] (64 bits)"
        )
    expected = -(-input_length // block_tokens)  # exact ceiling: no float overflow
    if len(ids) != expected:
        raise ValueError(
            f"{len(ids)} hash_ids for input_length {input_length}: "
            f"expected {expected} blocks of {block_tokens} tokens"
        )
    return tuple(ids)


class _ChainKeys:
    """Interns (previous key, block id) chains to small ints, first seen first.

    A chain's keys depend only on its block ids, so a turn whose ids begin with all of its
    parent turn's reuses the parent's keys for them and interns only the rest. The last
    ``REMEMBERED_CHATS`` chats' ids and keys are kept for that, which bounds the memory of a
    trace read lazily.
    """

    REMEMBERED_CHATS = 65_536

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}
        self._chats: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def keys(
        self, hash_ids: tuple[int, ...], chat_id: int | None = None, parent_id: int | None = None
    ) -> tuple[int, ...]:
        keys: list[int] = []
        parent = self._chats.get(parent_id) if parent_id is not None else None
        if parent is not None and hash_ids[: len(parent[0])] == parent[0]:
            keys.extend(parent[1])
        previous = keys[-1] if keys else -1
        ids = self._ids
        intern, append = ids.setdefault, keys.append  # bound once: this loop runs per block
        for block_id in hash_ids[len(keys) :]:
            previous = intern((previous, block_id), len(ids))
            append(previous)
        chain = tuple(keys)
        if chat_id is not None:
            self._chats.pop(chat_id, None)  # re-inserted last: the most recent is kept longest
            self._chats[chat_id] = (hash_ids, chain)
            if len(self._chats) > self.REMEMBERED_CHATS:
                del self._chats[next(iter(self._chats))]
        return chain


def _parse(
    record: dict[str, Any],
    fmt: TraceFormatName,
    index: int,
    line: int,
    chains: _ChainKeys,
    block_tokens: int,
) -> TraceRequest:
    input_length = _field_int(record, "input_length", 1)
    output_length = _field_int(record, "output_length", 0)
    ids = _hash_ids(record, input_length, block_tokens)
    if fmt == "mooncake":
        if len(set(ids)) != len(ids):
            position = next(i for i, block_id in enumerate(ids) if block_id in ids[:i])
            raise ValueError(
                f"hash id {ids[position]} repeats at block {position + 1}; Mooncake ids are "
                "prefix hashes, unique within a request"
            )
        return TraceRequest(
            index=index,
            line=line,
            timestamp_s=_field_number(record, "timestamp") / 1000.0,
            input_length=input_length,
            output_length=output_length,
            hash_ids=ids,
            keys=ids[: input_length // block_tokens],
            block_tokens=block_tokens,
        )
    parent = _field_int(record, "parent_chat_id", -1)
    parent_id = None if parent == -1 else parent
    kind = record.get("type", "text")
    if not isinstance(kind, str):
        raise ValueError(f"field 'type' must be a string, got {kind!r}")
    timestamp_s = _field_number(record, "timestamp")
    chat_id = _field_int(record, "chat_id", 0)
    return TraceRequest(
        index=index,
        line=line,
        timestamp_s=timestamp_s,
        input_length=input_length,
        output_length=output_length,
        hash_ids=ids,
        keys=chains.keys(ids[: input_length // block_tokens], chat_id, parent_id),
        block_tokens=block_tokens,
        chat_id=chat_id,
        parent_id=parent_id,
        turn=_field_int(record, "turn", 0) if "turn" in record else None,
        kind=kind,
    )


def read_trace(
    path: str | Path, fmt: str = "auto", *, block_tokens: int | None = None
) -> Iterator[TraceRequest]:
    """Yield the requests of trace ``path`` lazily, in file order.

    ``fmt`` is ``auto`` (decided by the first request line), ``mooncake`` or
    ``bailian``; ``block_tokens`` overrides the form's tokens per hash id.
    Blank lines are skipped. Timestamps must not decrease.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise TraceError(
            path, None, f"unknown trace format {fmt!r}; valid: auto, {', '.join(FORMATS)}"
        )
    if block_tokens is not None and block_tokens < 1:
        raise TraceError(path, None, f"block_tokens must be >= 1, got {block_tokens}")
    chosen: TraceFormatName | None = None if fmt == "auto" else fmt  # type: ignore[assignment]
    chains = _ChainKeys()
    previous_ts = 0.0
    index = 0
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed in finally, read lazily
    except OSError as error:
        raise TraceError(path, None, f"cannot open trace: {error.strerror}") from error
    try:
        for line_no, data in enumerate(handle, start=1):
            if line_no == 1:
                data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            if not data.strip(_JSON_BLANK.encode()):
                continue
            try:
                record = _load_line(data)
            except ValueError as error:
                raise TraceError(path, line_no, str(error)) from None
            if not isinstance(record, dict):
                raise TraceError(path, line_no, "expected a JSON object")
            if chosen is None:
                chosen = detect_format(record)
                if chosen is None:
                    raise TraceError(
                        path,
                        line_no,
                        "neither Mooncake nor Qwen-Bailian form (no 'hash_ids', no "
                        f"{' or '.join(repr(key) for key in sorted(BAILIAN_KEYS))})",
                    )
            form = detect_format(record)
            if form is not None and form != chosen:
                raise TraceError(path, line_no, f"a {form} line in a {chosen} trace")
            tokens = block_tokens or BLOCK_TOKENS[chosen]
            try:
                request = _parse(record, chosen, index, line_no, chains, tokens)
            except ValueError as error:
                raise TraceError(path, line_no, str(error)) from None
            if request.timestamp_s < previous_ts:
                raise TraceError(
                    path,
                    line_no,
                    f"timestamp goes back in time ({request.timestamp_s}s < "
                    f"{previous_ts}s on an earlier line)",
                )
            previous_ts = request.timestamp_s
            index += 1
            yield request
    except OSError as error:  # a read error mid-file (the path is a directory, an I/O error)
        raise TraceError(path, None, f"cannot read trace: {error.strerror}") from None
    finally:
        handle.close()


def load_trace(
    path: str | Path, fmt: str = "auto", *, block_tokens: int | None = None
) -> list[TraceRequest]:
    """Read the whole trace, so a malformed line stops a run before it starts."""
    # Reading makes many small containers and no reference cycles: the collector's passes
    # over the growing list would add about a fifth to the read.
    collecting = gc.isenabled()
    gc.disable()
    try:
        requests = list(read_trace(path, fmt, block_tokens=block_tokens))
    finally:
        if collecting:
            gc.enable()
    if not requests:
        raise TraceError(path, None, "the trace holds no requests")
    return requests


def trace_record(request: TraceRequest, fmt: TraceFormatName) -> dict[str, Any]:
    """The JSON object of ``request`` in form ``fmt`` (the inverse of reading)."""
    if fmt == "mooncake":
        return {
            "timestamp": round(request.timestamp_s * 1000),
            "input_length": request.input_length,
            "output_length": request.output_length,
            "hash_ids": list(request.hash_ids),
        }
    return {
        "chat_id": request.chat_id if request.chat_id is not None else request.index,
        "parent_chat_id": -1 if request.parent_id is None else request.parent_id,
        "timestamp": round(request.timestamp_s, 3),
        "input_length": request.input_length,
        "output_length": request.output_length,
        "type": request.kind if request.kind is not None else "text",
        "turn": request.turn if request.turn is not None else 1,
        "hash_ids": list(request.hash_ids),
    }


def write_trace(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Write trace records one JSON object a line; returns the number written."""
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, separators=(", ", ": ")) + "\n")
            count += 1
    return count
