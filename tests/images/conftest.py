"""Fixtures for the tests that run the built images (tests/images/containers.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from containers import runner_missing

from cluster.images import built_images


@pytest.fixture(scope="session")
def built_image() -> Callable[[str], str]:
    """The reference of a built image by name; skips, naming the target, when none was built
    here or this machine cannot run it."""
    built: dict[str, dict[str, Any]] = built_images()

    def reference(name: str) -> str:
        if name not in built:
            pytest.skip(f"no {name} image built here: `make images-local` builds it")
        if built[name]["builder"] != "buildah":
            pytest.skip(f"the {name} image was built by docker; these tests run buildah's images")
        missing = runner_missing()
        if missing:
            pytest.skip(f"cannot run images here: {missing}")
        return str(built[name]["reference"])

    return reference
