"""Plugin settings: environment variables and the live policy file (no vLLM needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from arc_evictor.vllm_plugin.config import PluginConfigError, PolicyFileWatcher, Settings
from arc_serving_common.names import CONFIG_ENV, POLICY_ENV, POLL_MS_ENV


def test_plugin_is_off_without_either_variable() -> None:
    assert Settings.from_env({}) is None


def test_unknown_policy_name_lists_valid_names() -> None:
    with pytest.raises(
        PluginConfigError, match="unknown eviction policy 'fifo'; valid policies: lru"
    ):
        Settings.from_env({POLICY_ENV: "fifo"})


def test_policy_name_is_case_insensitive() -> None:
    settings = Settings.from_env({POLICY_ENV: "ARC"})
    assert settings is not None and settings.policy == "arc" and settings.config_path is None


def test_config_file_wins_and_must_be_valid_at_start(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"policy": "dbl"}))
    settings = Settings.from_env({POLICY_ENV: "lru", CONFIG_ENV: str(path)})
    assert settings is not None and settings.policy == "dbl"
    for text, problem in [
        ("{", "not JSON"),
        ("[]", "expected an object"),
        ('{"policy": "arc", "extra": 1}', "unknown keys"),
        ('{"policy": 3}', "unknown eviction policy 3"),
    ]:
        path.write_text(text)
        with pytest.raises(PluginConfigError, match=problem):
            Settings.from_env({CONFIG_ENV: str(path)})
    with pytest.raises(PluginConfigError, match="cannot read"):
        Settings.from_env({CONFIG_ENV: str(tmp_path / "missing.json")})


def test_bad_poll_interval_is_refused() -> None:
    with pytest.raises(PluginConfigError, match=POLL_MS_ENV):
        Settings.from_env({POLICY_ENV: "lru", POLL_MS_ENV: "fast"})


def test_watcher_reports_a_change_once_and_keeps_policy_on_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"policy": "lru"}))
    watcher = PolicyFileWatcher(path, 0.1, "lru")
    assert watcher.poll(now=1.0) is None  # unchanged
    path.write_text(json.dumps({"policy": "arc"}))
    os.utime(path, ns=(1, 10**18))
    assert watcher.poll(now=1.05) is None  # not yet due
    assert watcher.poll(now=2.0) == "arc"
    assert watcher.poll(now=3.0) is None
    path.write_text("{broken")
    os.utime(path, ns=(1, 2 * 10**18))
    assert watcher.poll(now=4.0) is None
    error = watcher.take_error()
    assert error is not None and "not JSON" in error and "keeping policy arc" in error
    assert watcher.poll(now=5.0) is None and watcher.take_error() is None  # logged once
    assert watcher.current == "arc"
