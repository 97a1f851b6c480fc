"""How the key is handled without a server: VllmServer's key, the load test's settings and
summary. The real 401s and the places the key must never reach are in test_auth_server."""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_harness.vllm_server import VllmServer
from arc_loadtest.replay import ReplaySettings, auth_failure, auth_headers
from arc_loadtest.report import format_summary, summarize
from arc_serving_common.names import API_KEY_ENV


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Enough of a model folder for VllmServer's checks (nothing is started)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def prepared(server: VllmServer, tmp_path: Path) -> VllmServer:
    server.metrics_dir = tmp_path  # what start() sets before it builds the environment
    return server


def test_every_server_gets_its_own_random_key_by_default(model_dir: Path) -> None:
    first, second = VllmServer(model_dir), VllmServer(model_dir)
    assert first.api_key and second.api_key and first.api_key != second.api_key
    assert len(first.api_key) >= 40  # 32 random bytes, URL-safe base64
    assert first.auth_headers == {"Authorization": f"Bearer {first.api_key}"}


def test_the_key_goes_to_the_environment_never_the_command_line(
    model_dir: Path, tmp_path: Path
) -> None:
    server = prepared(VllmServer(model_dir, api_key="given-key-0123456789"), tmp_path)
    assert server.environment()[API_KEY_ENV] == "given-key-0123456789"
    command = server.command()
    assert not any("given-key" in arg or arg.startswith("--api-key") for arg in command)


def test_no_key_is_an_explicit_choice_and_ignores_the_callers_key(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "leaked-from-the-shell")
    server = prepared(VllmServer(model_dir, api_key=None), tmp_path)
    assert server.api_key is None and server.auth_headers == {}
    assert API_KEY_ENV not in server.environment()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"env": {API_KEY_ENV: "k"}}, "pass the API key as api_key=, not env VLLM_API_KEY"),
        ({"extra_args": ["--api-key", "k"]}, "not --api-key"),
        ({"extra_args": ["--api_key=k"]}, "not --api-key"),
        ({"api_key": ""}, "api_key must be a non-empty string without spaces"),
        ({"api_key": "two words"}, "api_key must be a non-empty string without spaces"),
    ],
)
def test_keys_that_would_leak_or_never_match_are_refused(
    model_dir: Path, options: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        VllmServer(model_dir, **options)


def test_replay_settings_never_show_the_key() -> None:
    settings = ReplaySettings(host="http://127.0.0.1:1", trace="t.jsonl", api_key="s3cret-key")
    assert "s3cret-key" not in repr(settings) and "s3cret-key" not in str(settings)
    assert auth_headers(settings.api_key) == {"Authorization": "Bearer s3cret-key"}
    assert auth_headers("") == {}


def test_a_key_with_a_line_break_is_refused_without_echoing_it() -> None:
    settings = ReplaySettings(host="http://127.0.0.1:1", trace="t.jsonl", api_key="ab\ncd-key")
    with pytest.raises(ValueError, match="must not contain spaces, line breaks") as caught:
        settings.validate()
    assert "cd-key" not in str(caught.value)


def test_auth_failures_say_what_to_do() -> None:
    assert "set LOADTEST_API_KEY or pass --api-key" in auth_failure(has_key=False)
    assert "rejected the API key" in auth_failure(has_key=True)


def row(index: int, status: int | None) -> dict:
    ok = status == 200
    return {"index": index, "ok": ok, "status": status, "ttft_s": 0.1 if ok else None,
            "itl_s": [], "e2e_s": 0.2, "lag_s": 0.0, "held_s": 0.0,
            "output_tokens": 1 if ok else 0}  # fmt: skip


def test_summary_counts_unauthorized_requests_and_says_authentication_failed() -> None:
    rows = [row(0, 200), row(1, 401), row(2, 401), row(3, None)]
    summary = summarize(rows, planned=4, start=None, end=None, duration_s=1.0)
    assert summary["requests_unauthorized"] == 2 and summary["requests_failed"] == 3
    assert summary["setup_error"] is None
    assert "authentication failed: 2 requests answered HTTP 401" in format_summary(summary)


def test_summary_of_a_replay_that_could_not_start_says_why() -> None:
    reason = auth_failure(has_key=False)
    summary = summarize([], planned=3, start=None, end=None, duration_s=0.0, setup_error=reason)
    assert summary["requests_sent"] == 0 and summary["setup_error"] == reason
    assert format_summary(summary).startswith(f"replay did not start: {reason}")
