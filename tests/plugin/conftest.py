"""Plugin tests: vLLM's real KV cache manager with the plugin installed in this process.

``patches.install`` patches vLLM classes for the whole test process; that is harmless to other
areas because every patched path checks for a ``PolicyBlockPool`` first, and the real servers
run in their own processes.
"""

from __future__ import annotations

import warnings

import pytest

with warnings.catch_warnings():
    # torch 2.13's torch.utils.mkldnn (imported by vLLM through torch.compile) still uses
    # torch.jit.script_method; not ours to fix, and pytest turns warnings into errors.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning
    )
    import managers  # noqa: F401  (imports vLLM once, here)


@pytest.fixture(scope="session", autouse=True)
def plugin_installed() -> None:
    from arc_evictor.vllm_plugin import patches

    patches.install("lru", on_step=lambda: None, on_pool=lambda pool: None)
