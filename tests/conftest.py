"""Fixtures shared by every area of the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_harness.tinymodel import build_tiny_llama


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local Llama every real vLLM server of the run serves (random weights, a local
    tokenizer, nothing downloaded), built once per run. vLLM serves it under its folder's name,
    ``tiny-llama``, unless a server names it otherwise."""
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
