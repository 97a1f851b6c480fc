"""Fuzz the plugin's policy file (``ARC_EVICTOR_CONFIG``) through the live-switch path.

The real ``PluginRuntime`` (its ``PolicyFileWatcher``) drives a real ``PolicyBlockPool`` inside
vLLM's own ``KVCacheManager`` holding cached blocks. Each case replaces the file (atomically,
as a ConfigMap update does) with random or mutated content, then runs the engine's per-step
hook. A bad file is logged once with a message naming the problem and leaves the policy
object, its name and every resident block as they were; a good file naming another policy
switches, keeping every resident block. Nothing but a log line comes out of the hook.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import count, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from arc_evictor.policies import policy_names
from arc_evictor.vllm_plugin import PluginRuntime
from arc_evictor.vllm_plugin.config import (
    MAX_FILE_BYTES,
    PluginConfigError,
    Settings,
    read_policy_file,
)
from arc_serving_common.names import CONFIG_ENV

with warnings.catch_warnings():
    # torch 2.13's torch.utils.mkldnn (imported by vLLM through torch.compile) still uses
    # torch.jit.script_method; not ours to fix, and pytest turns warnings into errors.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning
    )
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from arc_evictor.vllm_plugin import patches
    from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool

POLICIES = policy_names()
BLOCK = 4


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Engine:
    """A real KV cache manager with the plugin's pool, its runtime and the policy file."""

    manager: Any
    runtime: PluginRuntime
    path: Path
    log: Collect

    @property
    def pool(self) -> PolicyBlockPool:
        return self.manager.block_pool

    def state(self) -> tuple[Any, str, list[Any]]:
        policy = self.pool.policy
        return policy, policy.name, sorted(policy.resident_keys())

    def write(self, content: bytes) -> None:
        """Replace the file by a new one, the way the kubelet swaps a ConfigMap's files."""
        fd, temporary = tempfile.mkstemp(dir=self.path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        os.replace(temporary, self.path)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    init_none_hash(sha256)
    patches.install("lru", on_step=lambda: None, on_pool=lambda pool: None)  # idempotent
    patches.set_policy_name("arc")
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=33, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    manager = KVCacheManager(
        config,
        max_model_len=32 * BLOCK,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )
    assert isinstance(manager.block_pool, PolicyBlockPool)
    for number in range(6):  # cache some prefixes, then release them: resident, unpinned
        tokens = list(range(100 * number, 100 * number + 3 * BLOCK + 1))
        request = Request(
            request_id=f"fuzz{number}",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        computed, hit_tokens, _ = manager.get_computed_blocks(request)
        new = request.num_tokens - hit_tokens
        assert manager.allocate_slots(
            request, new, num_new_computed_tokens=hit_tokens, new_computed_blocks=computed
        )
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
    assert len(manager.block_pool.policy) > 0
    log = Collect()
    logger = logging.getLogger("vllm.arc_evictor")
    logger.addHandler(log)
    with tempfile.TemporaryDirectory(prefix="fuzz-plugin-") as folder:
        path = Path(folder) / "policy.json"
        path.write_text('{"policy": "arc"}')
        # poll_seconds 0: every step checks the file (the real default is 0.5 s).
        runtime = PluginRuntime(Settings(policy="arc", config_path=path, poll_seconds=0.0))
        yield Engine(manager, runtime, path, log)
    logger.removeHandler(log)
    patches.set_policy_name("lru")  # switches changed the process-wide default; restore it


def expected_policy(content: bytes) -> str | None:
    """The oracle: the policy a file names, or None when the file is bad."""
    if len(content) > MAX_FILE_BYTES:
        return None
    try:
        pairs_seen: list[int] = []

        def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            pairs_seen.append(len(pairs) - len(dict(pairs)))
            return dict(pairs)

        data = json.loads(content.decode("utf-8"), object_pairs_hook=hook)
    except (ValueError, RecursionError):
        return None
    if any(pairs_seen) or not isinstance(data, dict) or set(data) != {"policy"}:
        return None
    name = data["policy"]
    if isinstance(name, str) and name.strip().lower() in POLICIES:
        return name.strip().lower()
    return None


def apply(engine: Engine, content: bytes) -> None:
    before = engine.state()
    current = engine.runtime.watcher.current  # type: ignore[union-attr]
    engine.log.records.clear()
    engine.write(content)
    engine.runtime.on_step()  # raises nothing, whatever the file holds
    wanted = expected_policy(content)
    after = engine.state()
    messages = [record.getMessage() for record in engine.log.records]
    if wanted is None:
        assert after[0] is before[0] and after[1:] == before[1:], content[:200]
        assert engine.runtime.watcher.current == current  # type: ignore[union-attr]
        errors = [r for r in engine.log.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, (content[:200], messages)
        message = errors[0].getMessage()
        assert f"{CONFIG_ENV}={engine.path}: " in message, message
        assert message.endswith(f"; keeping policy {current}"), message
        assert len(message) < 1_000, message  # one readable log line
    else:
        assert not [r for r in engine.log.records if r.levelno >= logging.WARNING], messages
        assert after[1] == wanted and engine.runtime.watcher.current == wanted  # type: ignore[union-attr]
        assert after[2] == before[2], "a switch lost or invented resident blocks"
        if wanted == before[1]:
            assert after[0] is before[0]  # no switch to the same policy


names = (
    st.sampled_from(POLICIES)
    | st.sampled_from(POLICIES).map(str.upper)
    | st.sampled_from(
        [" arc ", "Arc", "lfu", "", " ", "arc,lru", "LRU\n", "a\u0307rc", "ARC\x00", "random"]
    )
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10) | names,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["policy", "Policy", "x"]) | st.text(max_size=5), children, max_size=3
        )
    ),
    max_leaves=8,
)


@st.composite
def contents(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["good", "bytes", "json", "object", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=80))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    policy: Any = draw(names | json_values)
    record: dict[str, Any] = {"policy": policy}
    if kind == "good":
        record = {"policy": draw(names)}
    elif kind == "object":
        record.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)))
    text = json.dumps(record)
    if kind == "mutated":
        mutation = draw(
            st.sampled_from(
                ["duplicate", "truncate", "bom", "latin-1", "crlf", "nest", "trailing", "empty"]
            )
        )
        if mutation == "duplicate":
            text = text[:-1] + ', "policy": "lru"}'
        elif mutation == "truncate":
            text = text[: draw(st.integers(0, len(text) - 1))]
        elif mutation == "bom":
            return b"\xef\xbb\xbf" + text.encode()
        elif mutation == "latin-1":
            return text.replace('"policy"', '"pol\xefcy"').encode("latin-1")
        elif mutation == "crlf":
            text = text.replace(" ", "\r\n ") + "\r\n"
        elif mutation == "nest":
            text = "[" * draw(st.integers(1, 100_000))
        elif mutation == "trailing":
            text += draw(st.sampled_from([",", "}", " x", "\n{}", " "]))
        else:
            text = ""
    return text.encode()


@given(content=contents())
@fuzz_settings(3_000)
def test_bad_policy_files_keep_the_running_policy(engine: Engine, content: bytes) -> None:
    count("plugin config: file contents")
    apply(engine, content)


@given(size=st.integers(MAX_FILE_BYTES - 64, 4 * MAX_FILE_BYTES), filler=st.sampled_from(" \n\t"))
@fuzz_settings(50)
def test_huge_policy_files_are_refused(engine: Engine, size: int, filler: str) -> None:
    count("plugin config: huge files")
    body = '{"policy": "dbl"}'
    apply(engine, (filler * max(0, size - len(body)) + body).encode())


@given(kind=st.sampled_from(["missing", "folder", "dangling link"]), then=st.sampled_from(POLICIES))
@fuzz_settings(60)
def test_missing_or_unreadable_files_keep_the_policy(engine: Engine, kind: str, then: str) -> None:
    count("plugin config: unreadable paths")
    before = engine.state()
    engine.log.records.clear()
    engine.path.unlink(missing_ok=True)
    if kind == "folder":
        engine.path.mkdir()
    elif kind == "dangling link":
        engine.path.symlink_to(engine.path.parent / "nowhere.json")
    engine.runtime.on_step()
    assert engine.state()[0] is before[0] and engine.state()[1:] == before[1:]
    errors = [r.getMessage() for r in engine.log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "cannot read" in errors[0], errors
    if kind == "folder":
        engine.path.rmdir()
    else:
        engine.path.unlink(missing_ok=True)
    apply(engine, json.dumps({"policy": then}).encode())  # and the watcher still works


def test_undecodable_or_deep_files_are_config_errors(tmp_path: Path) -> None:
    """Found by fuzzing: a non-UTF-8 file raised UnicodeDecodeError and deep nesting raised
    RecursionError out of the per-step hook, which would stop the engine."""
    path = tmp_path / "policy.json"
    for content, problem in [
        (b'{"policy": "\xe9"}', "not UTF-8 text"),
        (b"[" * 50_000, "nested too deeply"),
        (b'{"policy": "arc", "policy": "lru"}', "'policy' appears twice"),
        (b" " * (MAX_FILE_BYTES + 1), "larger than"),
    ]:
        path.write_bytes(content)
        with pytest.raises(PluginConfigError, match=problem):
            read_policy_file(path)
