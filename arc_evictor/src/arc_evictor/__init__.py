"""arc-evictor: prefix-cache eviction policies (``policies``) and the vLLM plugin that drives
vLLM's block pool with them (``vllm_plugin``). What a serving pod installs.

The policy core ships compiled (mypyc); ``ARC_EVICTOR_PURE_PYTHON=1`` in the environment makes
this package load the policies' Python sources instead, for the fallback's tests and the
benchmark's pure-Python column (``policies.compiled`` tells which is loaded).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

__version__ = "0.1.0"


class _PolicySourcesFirst(MetaPathFinder):
    """Finds ``arc_evictor.policies.*`` in their ``.py`` files, never the compiled modules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not fullname.startswith("arc_evictor.policies.") or path is None:
            return None
        name = fullname.rpartition(".")[2]
        for folder in path:
            source = os.path.join(folder, f"{name}.py")
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


if os.environ.get("ARC_EVICTOR_PURE_PYTHON") == "1":
    sys.meta_path.insert(0, _PolicySourcesFirst())
