"""Builds arc-evictor with its policy core compiled by mypyc (docs/plugin.md, "Compiled core").

The policy modules compile to C extension modules that sit next to their sources in the
wheel; ``ARC_EVICTOR_PURE_PYTHON=1`` at build time builds the pure-Python wheel instead, and
at run time makes the package load the sources even where compiled modules are installed.
Everything else (metadata, the vLLM entry point) is in ``pyproject.toml``.
"""

from __future__ import annotations

import os

from setuptools import setup

# The modules on the eviction hot path. statistics.py stays Python: it declares a runtime
# Protocol, which mypyc cannot compile, and nothing on the hot path calls into it.
COMPILED = ["base", "lru", "arc", "lfu", "s3fifo", "sieve", "trio"]

if os.environ.get("ARC_EVICTOR_PURE_PYTHON") == "1":
    ext_modules = []
else:
    from mypyc.build import mypycify

    ext_modules = mypycify(
        [f"src/arc_evictor/policies/{name}.py" for name in COMPILED],
        opt_level="3",
        # The shared runtime library lands inside the package, not at the wheel's top level.
        group_name="arc_evictor.policies.core",
    )

setup(ext_modules=ext_modules)
