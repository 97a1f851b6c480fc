"""The API key never reaches Locust's web UI (the real Locust, started with its UI)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from arc_harness.vllm_server import free_port
from arc_loadtest.run import LOCUSTFILE

pytestmark = [pytest.mark.locust]

KEY = "ui-must-not-show-this-key-0123"


def test_the_web_ui_neither_shows_nor_asks_for_the_api_key(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 16, "output_length": 2, "hash_ids": [1]}\n')
    port = free_port()
    env = {**os.environ, "LOADTEST_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--web-host", "127.0.0.1",
               "--web-port", str(port), "--host", "http://127.0.0.1:1", "--trace", str(trace),
               "--seed", "3"]  # fmt: skip
    locust = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        page = None
        deadline = time.monotonic() + 60
        while page is None and time.monotonic() < deadline:
            assert locust.poll() is None, locust.communicate()[0].decode(errors="replace")
            try:
                page = requests.get(f"http://127.0.0.1:{port}/", timeout=5).text
            except requests.ConnectionError:
                time.sleep(0.3)
        assert page is not None, "Locust's web UI did not come up within 60 s"
    finally:
        locust.terminate()
        locust.communicate(timeout=30)
    found = re.search(r"window\.templateArgs = (\{.*\})", page)
    assert found, page[:2000]
    options = json.loads(found.group(1))["extra_options"]
    assert "api_key" not in options, options
    assert KEY not in page
