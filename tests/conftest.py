"""Fixtures shared by every area of the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_harness.tinymodel import build_tiny_llama

CLUSTER_TESTS = Path(__file__).parent / "cluster"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The local control plane's tests run last, in their own order: their cluster (etcd, the
    API server, the controllers, kwok) runs from the first of them to the end of the session,
    and would take CPU from every test after them."""
    items.sort(key=lambda item: item.path.is_relative_to(CLUSTER_TESTS))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local Llama every real vLLM server of the run serves (random weights, a local
    tokenizer, nothing downloaded), built once per run. vLLM serves it under its folder's name,
    ``tiny-llama``, unless a server names it otherwise."""
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
