"""Fixtures of the KV-event tests: one real vLLM CPU server with the plugin, publishing events.

The server starts once per module (a start takes 40-90 s on two cores) with a small pool, so
the workload evicts, with vLLM's KV-cache events published over ZMQ to the test's own
subscriber, with its dev endpoints on (``VLLM_SERVER_DEV_MODE=1`` registers
``POST /reset_prefix_cache``; the plugin's API-key guard covers it) and with
``--enable-prompt-tokens-details`` (each completion reports the prompt tokens it found in
the prefix cache). The policy comes from a file the tests rewrite for live switches
(docs/plugin.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from arc_harness.vllm_server import VllmServer
from arc_serving_common.names import CONFIG_ENV, POLL_MS_ENV
from tests.kv_events.events import EventStream

BLOCK = 32  # vLLM's CPU block size must be a multiple of 32
NUM_BLOCKS = 17  # the null block and 16 cacheable blocks
FIRST_POLICY = "lru"


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kv-events-policy") / "policy.json"
    path.write_text(json.dumps({"policy": FIRST_POLICY}))
    return path


@pytest.fixture(scope="module")
def event_stream() -> Iterator[EventStream]:
    stream = EventStream()
    yield stream
    stream.close()


@pytest.fixture(scope="module")
def server(
    model_dir: Path,
    policy_file: Path,
    event_stream: EventStream,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": event_stream.endpoint,  # no "*": vLLM connects to the test's socket
        "topic": "",
    }
    env = {
        CONFIG_ENV: str(policy_file),
        POLL_MS_ENV: "50",
        "VLLM_SERVER_DEV_MODE": "1",
    }
    with VllmServer(
        model_dir,
        block_size=BLOCK,
        num_gpu_blocks=NUM_BLOCKS,
        served_model_name="tiny",
        env=env,
        extra_args=[
            "--kv-events-config",
            json.dumps(events_config),
            "--enable-prompt-tokens-details",
        ],
        log_path=tmp_path_factory.mktemp("kv-events-log") / "vllm.log",
    ) as srv:
        print(f"vLLM server started in {srv.startup_seconds:.1f} s")
        yield srv
