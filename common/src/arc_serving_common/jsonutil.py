"""JSON helpers shared by the readers of untrusted JSON (traces, the plugin's policy file)."""

from __future__ import annotations

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
