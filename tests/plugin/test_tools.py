"""The shared helpers: the tiny model builder and the server wrapper's input checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arc_harness.tinymodel import build_tiny_llama, main
from arc_harness.vllm_server import VllmServer


def test_tiny_llama_is_a_servable_model_directory_and_is_reused(tmp_path: Path) -> None:
    out = build_tiny_llama(tmp_path / "m", seed=1, vocab_size=256)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 256
    assert config["hidden_size"] // config["num_attention_heads"] % 32 == 0
    assert config["max_position_embeddings"] >= 4096
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_llama(out, seed=1, vocab_size=256) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_tiny_llama_tokenizer_round_trips_words(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = build_tiny_llama(tmp_path / "m", seed=2, vocab_size=256)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("ba ke")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 2 and tokenizer.eos_token_id == 3
    assert len(tokenizer) == 256


def test_tiny_llama_refuses_bad_parameters_and_foreign_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        build_tiny_llama(tmp_path / "a", hidden_size=64, num_heads=4)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny-model directory"):
        build_tiny_llama(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"
    assert main([str(foreign)]) == 2


def test_server_refuses_cpu_incompatible_settings(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmServer(model, block_size=16)
    with pytest.raises(ValueError, match="max_model_len 4096"):
        VllmServer(model, num_gpu_blocks=8, max_model_len=4096)
    with pytest.raises(ValueError, match="not a model directory"):
        VllmServer(tmp_path / "nowhere")
    server = VllmServer(model, num_gpu_blocks=9)
    assert server.max_model_len == 8 * 32
    assert "--enable-prefix-caching" in server.command()
