"""Builders for small traces written to temporary files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def write_lines(tmp_path: Path):
    """Write raw lines (dicts become JSON) to a fresh trace file; returns its path."""

    def write(lines: Iterable[Any], name: str = "trace.jsonl") -> Path:
        path = tmp_path / name
        with path.open("w", encoding="utf-8") as handle:
            for line in lines:
                handle.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        return path

    return write
