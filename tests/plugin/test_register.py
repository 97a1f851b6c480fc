"""The plugin's entry point checks the vLLM version before it imports any vLLM internals."""

from __future__ import annotations

import re
import sys

import pytest
import vllm

import arc_evictor.vllm_plugin as plugin
from arc_evictor.vllm_plugin.version import UnsupportedVllmError, check_vllm_version, vllm_series
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV


@pytest.mark.parametrize("version", ["0.31.1", "0.34.0", "1.32.0", "0.3.2"])
def test_unsupported_vllm_version_is_refused_with_a_clear_message(version: str) -> None:
    message = rf"supports vLLM 0\.32\.\*, 0\.33\.\* .*found vLLM {re.escape(version)}\."
    with pytest.raises(UnsupportedVllmError, match=message):
        check_vllm_version(version)


@pytest.mark.parametrize(("version", "series"), [("0.32.0", "0.32"), ("0.33.0", "0.33"),
                                                 ("0.33.1rc1", "0.33")])  # fmt: skip
def test_each_supported_release_maps_to_its_series(version: str, series: str) -> None:
    assert vllm_series(version) == series
    check_vllm_version()  # the installed vLLM is a supported one


def test_register_checks_the_version_before_importing_vllm_internals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(POLICY_ENV, "lru")
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(plugin, "_runtime", None)
    # Importing the module that patches vLLM now fails, as it may on another vLLM whose
    # internals moved.
    monkeypatch.delattr(plugin, "patches")
    monkeypatch.setitem(sys.modules, "arc_evictor.vllm_plugin.patches", None)

    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(UnsupportedVllmError, match=r"found vLLM 0\.31\.1"):
        plugin.register()
    assert plugin._runtime is None  # nothing was installed

    # With the supported version the check passes and register goes on to import it.
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    with pytest.raises(ImportError, match=r"arc_evictor\.vllm_plugin\.patches"):
        plugin.register()
    assert plugin._runtime is None


def test_register_does_nothing_without_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(plugin, "_runtime", None)
    monkeypatch.setattr(vllm, "__version__", "0.31.1")  # not even checked
    plugin.register()
    assert plugin._runtime is None


def test_an_api_key_alone_installs_the_guard_on_the_supported_vllm_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from arc_evictor.vllm_plugin.auth import authenticate_every_path

    # Restored at teardown: the patch is process-wide.
    monkeypatch.setattr(AuthenticationMiddleware, "__call__", AuthenticationMiddleware.__call__)
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setattr(plugin, "_runtime", None)
    monkeypatch.setattr(plugin, "_guarded", False)
    # Another vLLM: start-up stops rather than serve with vLLM's narrower guard.
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(UnsupportedVllmError, match=r"found vLLM 0\.31\.1"):
        plugin.register()
    assert AuthenticationMiddleware.__call__ is not authenticate_every_path
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    plugin.register()
    assert AuthenticationMiddleware.__call__ is authenticate_every_path
    assert plugin._runtime is None  # no policy settings: the block pool is vLLM's own
