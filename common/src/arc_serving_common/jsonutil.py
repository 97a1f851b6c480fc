"""JSON helpers shared by the readers of untrusted JSON (traces, the plugin's policy file)."""

from __future__ import annotations

import json
from typing import Any


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` refusing a key repeated in one object.

    Plain ``json.loads`` keeps the last of repeated keys silently; a file saying two things
    is refused instead (ValueError naming the first repeated key, in file order).
    """
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key!r} appears twice in one object")
            seen.add(key)
    return record


_UNIQUE_KEYS_DECODER = json.JSONDecoder(object_pairs_hook=unique_keys)


def loads_unique(text: str) -> Any:
    """``json.loads(text, object_pairs_hook=unique_keys)`` through one decoder built once.

    ``json.loads`` builds a new decoder on every call that passes a hook, which a trace reader
    pays on every line. Its refusal of a leading byte-order mark is kept, message and all.
    """
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _UNIQUE_KEYS_DECODER.decode(text)
