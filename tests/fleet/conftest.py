"""Fixtures of the fleet tests (real vLLM CPU servers behind the real vLLM router).

Each test module starts at most one ``arc_harness.fleet.Fleet`` (two vLLM servers) at a time, on
a port range of its own, and stops it when the module ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_harness.tinymodel import build_tiny_llama


@pytest.fixture(scope="session")
def fleet_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local Llama (random weights, local tokenizer; nothing is downloaded)."""
    return build_tiny_llama(tmp_path_factory.mktemp("fleet-model"))
