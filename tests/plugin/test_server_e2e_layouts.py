"""End to end: the real vLLM CPU server with the plugin on sliding-window models.

The tiny local Llama (``arc_harness.tinymodel``) is re-labelled two ways, its weights unchanged:

- ``hybrid``: Hugging Face ``layer_types`` (layer 0 sliding-window attention over 64 tokens,
  layer 1 full attention), which vLLM's Llama reads per layer. vLLM builds a
  HybridKVCacheCoordinator with a full-attention and a sliding-window group sharing one pool.
- ``mistral``: ``MistralForCausalLM`` with a 64-token ``sliding_window`` on every layer (the
  weights are named as Llama's): one sliding-window group.

A repeated prompt of 4 blocks and a token hits 4 blocks (128 tokens) in vLLM's count; the
plugin commits the full-attention group's 4 blocks and the sliding group's 2 window blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_server_e2e import complete, metrics, prompt, value, wait_for

from arc_harness.vllm_server import VllmServer
from arc_serving_common.names import POLICY_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
WINDOW = 2 * BLOCK
# name -> (config.json changes, policy, block hits the plugin commits on the repeat)
MODELS: dict[str, tuple[dict[str, Any], str, int]] = {
    "hybrid": (
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW},
        "arc",
        4 + 2,
    ),
    "mistral": (
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "sliding_window": WINDOW,
        },
        "lru",
        2,
    ),
}


def model_variant(model_dir: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the tiny Llama with ``MODELS[name]``'s config changes."""
    model = tmp_path / f"tiny-{name}"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(MODELS[name][0])
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("name", MODELS)
def test_sliding_window_model_serves_with_the_plugin_and_hits_per_group(
    name: str, model_dir: Path, tmp_path: Path
) -> None:
    _, policy, expected_hits = MODELS[name]
    model = model_variant(model_dir, tmp_path, name)
    with VllmServer(
        model,
        block_size=BLOCK,
        num_gpu_blocks=49,  # two groups need a block each per 32 tokens of max_model_len
        max_model_len=512,
        served_model_name="tiny",
        env={POLICY_ENV: policy},
        log_path=tmp_path / "server.log",
    ) as server:
        assert f"evicts by {policy}" in server.log_tail(4000)
        before = metrics(server)
        hot = prompt(7, 4)  # 4 full blocks and one token
        complete(server, hot)
        complete(server, hot)
        m = wait_for(
            server,
            lambda m: (
                value(m, "arc_evictor_block_hits_total")
                > value(before, "arc_evictor_block_hits_total")
            ),
        )
        hits = value(m, "arc_evictor_block_hits_total") - value(
            before, "arc_evictor_block_hits_total"
        )
        assert hits == expected_hits
        assert (
            value(m, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
            == 4 * BLOCK
        )


def test_hybrid_model_hashed_finer_than_its_blocks_decodes_across_a_block(
    model_dir: Path, tmp_path: Path
) -> None:
    # A layout whose groups hash finer than their blocks, as the CPU build can make it (its
    # blocks are multiples of 32 tokens and the tiny model's layers share one page size): both
    # groups of the hybrid Llama hold 32 tokens a block and requests are hashed every 16
    # (--prefix-match-unit, what vLLM sets to the gcd of the block sizes when pages differ).
    # Full attention then caches the prompt's partial last block: a 60-token prompt does so on
    # its 4th decode step (63 -> 64 computed tokens), which stopped the engine before the
    # plugin modelled it.
    _, policy, _ = MODELS["hybrid"]
    model = model_variant(model_dir, tmp_path, "hybrid")
    with VllmServer(
        model,
        block_size=BLOCK,
        num_gpu_blocks=49,
        max_model_len=512,
        served_model_name="tiny",
        env={POLICY_ENV: policy},
        extra_args=["--prefix-match-unit", "16"],
        log_path=tmp_path / "server.log",
    ) as server:
        log = server.log_tail(20000)
        assert f"evicts by {policy}" in log
        assert "kv cache group sizes (32, 32)" in log
        before = metrics(server)
        sixty = prompt(11, 1)[:33] + prompt(12, 1)[:27]
        assert len(complete(server, sixty, max_tokens=8)["choices"][0]["text"]) > 0
        again = complete(server, sixty + prompt(13, 1), max_tokens=2)
        assert again["usage"]["completion_tokens"] == 2
        m = wait_for(
            server,
            lambda m: (
                value(m, "vllm:prefix_cache_hits_total")
                > value(before, "vllm:prefix_cache_hits_total")
            ),
        )
        # Block 0 hits; block 1 holds decoded tokens the second prompt does not share, and the
        # 48-token partial key serves only partial prefix-cache hits (off, as vLLM builds it).
        assert (
            value(m, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
            == BLOCK
        )
