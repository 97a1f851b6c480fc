"""Builders shared by the load-test tests: small traces written in the public forms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def write_lines(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def conversation_records(
    *, sessions: int = 3, turns: int = 3, block_tokens: int = 32, spacing_s: float = 0.3
) -> list[dict[str, Any]]:
    """Qwen-Bailian records: sessions share a 2-block system prompt; turn n+1 extends turn n
    by two blocks; each prompt's last block is partial (7 tokens short)."""
    records = []
    chat = 0
    for session in range(sessions):
        ids = [100, 101]
        parent = -1
        for turn in range(1, turns + 1):
            ids = [*ids, 1000 * session + 10 * turn, 1000 * session + 10 * turn + 1]
            chat += 1
            records.append(
                {
                    "chat_id": chat,
                    "parent_chat_id": parent,
                    "timestamp": round(session * 0.1 + turn * spacing_s, 3),
                    "input_length": len(ids) * block_tokens - 7,
                    "output_length": 2 + turn,
                    "type": "text",
                    "turn": turn,
                    "hash_ids": list(ids),
                }
            )
            parent = chat
    return sorted(records, key=lambda r: r["timestamp"])


@pytest.fixture
def conversation_trace(tmp_path: Path) -> Path:
    return write_lines(tmp_path / "conversation.jsonl", conversation_records())
