"""The plugin's settings: environment variables and the live policy file.

- ``ARC_EVICTOR_POLICY``: the policy to start with (``lru``, ``dbl``, ``arc``, ...).
- ``ARC_EVICTOR_CONFIG``: path of a JSON file ``{"policy": "arc"}`` (a mounted ConfigMap). It
  must be valid at start-up and then wins over ``ARC_EVICTOR_POLICY``; when it changes, the
  engine switches policy between scheduler steps. A malformed file later on leaves the running
  policy in place and logs why, once per change of the file.
- ``ARC_EVICTOR_POLL_MS``: how often the file is checked at most (default 500 ms).

The file is checked only before a scheduler step, by the engine core itself (the plugin starts
no thread): an idle engine keeps its policy, and its metrics keep reporting that policy, until
a request arrives; the switch then happens before that request is scheduled. This is the
documented behaviour, not a lag to tune: nothing is cached or evicted while the engine is idle.

Nothing here imports vLLM, so settings are validated (and tested) without it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from arc_evictor.policies import policy_names
from arc_serving_common.jsonutil import loads_unique
from arc_serving_common.names import (
    CONFIG_ENV,
    POLICY_ENV,
    POLICY_FILE_KEY,
    POLL_MS_ENV,
    policy_file_text,
)

DEFAULT_POLL_MS = 500
# What a valid file looks like, for the messages: {"policy": "arc"}.
FILE_EXAMPLE = policy_file_text("arc").strip()
# The file is one short JSON object; anything longer is a mistake (a wrong path, a log file),
# and reading it whole between scheduler steps would stall the engine.
MAX_FILE_BYTES = 64 * 1024


class PluginConfigError(ValueError):
    """A setting or the policy file is invalid; the message names the problem and the fix."""


def validate_policy_name(name: object, source: str) -> str:
    """The lower-case registry name for ``name``; PluginConfigError lists valid names."""
    valid = policy_names()
    if isinstance(name, str) and name.strip().lower() in valid:
        return name.strip().lower()
    shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."  # one log line
    raise PluginConfigError(
        f"{source}: unknown eviction policy {shown}; valid policies: {', '.join(valid)}"
    )


def read_policy_file(path: Path) -> str:
    """The policy named by the JSON file at ``path``; PluginConfigError says what is wrong.

    Only PluginConfigError is raised, whatever the file holds: the caller runs between
    scheduler steps and must not take the engine down over a bad file.
    """
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise PluginConfigError(f"{CONFIG_ENV}={path}: cannot read: {exc.strerror}") from exc
    if len(raw) > MAX_FILE_BYTES:
        raise PluginConfigError(
            f"{CONFIG_ENV}={path}: larger than {MAX_FILE_BYTES} bytes; expected {FILE_EXAMPLE}"
        )
    try:
        data = loads_unique(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PluginConfigError(f"{CONFIG_ENV}={path}: not UTF-8 text: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise PluginConfigError(f"{CONFIG_ENV}={path}: not JSON: {exc}") from None
    except RecursionError:
        raise PluginConfigError(f"{CONFIG_ENV}={path}: not JSON: nested too deeply") from None
    except ValueError as exc:  # a repeated key, an integer past Python's digit limit
        raise PluginConfigError(f"{CONFIG_ENV}={path}: not usable JSON: {exc}") from None
    if not isinstance(data, dict) or POLICY_FILE_KEY not in data:
        raise PluginConfigError(f"{CONFIG_ENV}={path}: expected an object {FILE_EXAMPLE}")
    unknown = sorted(set(data) - {POLICY_FILE_KEY})
    if unknown:
        raise PluginConfigError(
            f"{CONFIG_ENV}={path}: unknown keys {unknown}; only {POLICY_FILE_KEY!r}"
        )
    return validate_policy_name(data[POLICY_FILE_KEY], f"{CONFIG_ENV}={path}")


@dataclass(frozen=True, slots=True)
class Settings:
    """What the environment asks for; ``None`` from ``from_env`` means the plugin is off."""

    policy: str
    config_path: Path | None
    poll_seconds: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings | None:
        """Parse and validate; raises PluginConfigError on any bad value."""
        env = os.environ if env is None else env
        raw_policy = env.get(POLICY_ENV, "").strip()
        raw_config = env.get(CONFIG_ENV, "").strip()
        if not raw_policy and not raw_config:
            return None
        raw_poll = env.get(POLL_MS_ENV, str(DEFAULT_POLL_MS)).strip()
        try:
            poll_ms = int(raw_poll)
        except ValueError:
            poll_ms = -1
        if poll_ms < 10:
            raise PluginConfigError(f"{POLL_MS_ENV}={raw_poll!r}: expected an integer >= 10")
        policy = validate_policy_name(raw_policy, POLICY_ENV) if raw_policy else None
        config_path = Path(raw_config) if raw_config else None
        if config_path is not None:
            policy = read_policy_file(config_path)
        assert policy is not None
        return cls(policy=policy, config_path=config_path, poll_seconds=poll_ms / 1000)


class PolicyFileWatcher:
    """Polls the policy file at most every ``poll_seconds``; reports a new valid policy name.

    Invariant: ``_signature`` is the (mtime_ns, size, inode) of the file content last judged, so
    an unchanged file is neither re-read nor re-logged.
    """

    def __init__(self, path: Path, poll_seconds: float, current: str) -> None:
        self.path = path
        self.poll_seconds = poll_seconds
        self.current = current
        self.last_error: str | None = None
        self._next_check = 0.0
        self._signature = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the ConfigMap's ..data symlink swap
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self, now: float | None = None) -> str | None:
        """A policy name to switch to, or None; a bad file sets ``last_error`` and returns None."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return None
        self._next_check = now + self.poll_seconds
        signature = self._stat()
        if signature == self._signature:
            return None
        self._signature = signature
        try:
            name = read_policy_file(self.path)
        except PluginConfigError as exc:
            self.last_error = f"{exc}; keeping policy {self.current}"
            return None
        if name == self.current:
            return None
        self.current = name
        return name

    def take_error(self) -> str | None:
        """The problem found by the last ``poll``, once (for the log)."""
        error, self.last_error = self.last_error, None
        return error
