"""The policy core under test is the one meant: compiled (mypyc) in ``make test``, the
pure-Python fallback when ``ARC_EVICTOR_PURE_PYTHON=1`` (``make test-pure``).

The build in a development virtualenv is in place (``pip install -e arc_evictor`` compiles
next to the sources), so editing a policy needs a rebuild; the second test says so (an
installed wheel is left alone: installing sets its files' times)."""

from __future__ import annotations

import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import arc_evictor.policies as policies

PURE = os.environ.get("ARC_EVICTOR_PURE_PYTHON") == "1"
COMPILED_MODULES = ("base", "lru", "arc", "lfu", "s3fifo", "sieve", "trio")


def test_the_policy_core_loaded_is_the_build_under_test() -> None:
    assert policies.compiled() is not PURE
    for name in COMPILED_MODULES:
        path = getattr(policies, name).__file__
        assert path.endswith(tuple(EXTENSION_SUFFIXES)) is not PURE, f"{name} from {path}"


def test_compiled_modules_are_built_from_the_current_sources() -> None:
    folder = Path(policies.__file__).parent
    if PURE or "site-packages" in folder.parts:
        return  # an installed wheel ships the sources it was built from, mtimes aside
    # Every module's code is in the group's shared library; each module's own extension is a
    # shim that a rebuild leaves alone while its name stays.
    (built,) = folder.glob("core__mypyc.*")
    for name in COMPILED_MODULES:
        source = folder / f"{name}.py"
        assert built.stat().st_mtime >= source.stat().st_mtime, (
            f"{built.name} is older than {source.name}: rebuild the policy core "
            "(.venv/bin/pip install --no-deps -e arc_evictor)"
        )
