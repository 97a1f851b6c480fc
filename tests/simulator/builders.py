"""Small trace records for tests."""

from __future__ import annotations


def mooncake(timestamp_ms: int, hash_ids: list[int], *, output: int = 4, tail: int = 0) -> dict:
    """A Mooncake record whose blocks are all full (plus ``tail`` tokens in a partial block)."""
    return {
        "timestamp": timestamp_ms,
        "input_length": 512 * (len(hash_ids) - (1 if tail else 0)) + tail,
        "output_length": output,
        "hash_ids": hash_ids,
    }


def bailian(chat_id: int, parent: int, timestamp: float, hash_ids: list[int], **extra) -> dict:
    return {
        "chat_id": chat_id,
        "parent_chat_id": parent,
        "timestamp": timestamp,
        "input_length": 16 * len(hash_ids) + 1,
        "output_length": 8,
        "type": "text",
        "turn": extra.pop("turn", 1),
        "hash_ids": [*hash_ids, 999_999],
        **extra,
    }
