"""Hash ids to token ids: deterministic, prefix-preserving, never special, same everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arc_loadtest.tokens import TokenMapper, Vocabulary, VocabularyError, vocabulary_from_tokenizer

VOCAB = Vocabulary.build(range(200), special={0, 1, 2, 3}, source="test")


def make_mapper(seed: int = 7, block_tokens: int = 16) -> TokenMapper:
    return TokenMapper(VOCAB, seed=seed, block_tokens=block_tokens)


def test_same_seed_and_id_give_same_block_in_separate_mappers() -> None:
    assert make_mapper().block(42).tolist() == make_mapper().block(42).tolist()


def test_different_ids_or_seeds_give_different_blocks() -> None:
    mapper = make_mapper()
    assert mapper.block(1).tolist() != mapper.block(2).tolist()
    assert make_mapper(seed=1).block(1).tolist() != make_mapper(seed=2).block(1).tolist()


def test_blocks_never_hold_special_tokens() -> None:
    mapper = make_mapper(block_tokens=64)
    drawn = np.concatenate([mapper.block(h) for h in range(300)])
    assert set(drawn.tolist()) <= set(VOCAB.allowed)
    assert not set(drawn.tolist()) & VOCAB.special


def test_prompt_is_blocks_in_order_with_last_block_trimmed() -> None:
    mapper = make_mapper(block_tokens=16)
    prompt = mapper.prompt([5, 6, 7], input_length=40)
    assert len(prompt) == 40
    assert prompt[:16] == mapper.block(5).tolist()
    assert prompt[16:32] == mapper.block(6).tolist()
    assert prompt[32:] == mapper.block(7).tolist()[:8]


def test_requests_sharing_leading_ids_share_leading_tokens() -> None:
    mapper = make_mapper(block_tokens=16)
    a = mapper.prompt([9, 10, 11], input_length=48)
    b = mapper.prompt([9, 10, 12], input_length=48)
    assert a[:32] == b[:32] and a[32:] != b[32:]


def test_prompt_longer_than_its_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="needs more than 2 blocks"):
        make_mapper(block_tokens=16).prompt([1, 2], input_length=33)


def test_bounded_cache_does_not_change_blocks() -> None:
    small = TokenMapper(VOCAB, seed=3, block_tokens=8, cache_blocks=2)
    first = [small.block(h).tolist() for h in range(5)]
    assert [small.block(h).tolist() for h in range(5)] == first


_WORKER_SCRIPT = """
import json, sys
from arc_loadtest.tokens import TokenMapper, Vocabulary
vocab = Vocabulary.build(range(200), special={0, 1, 2, 3}, source="test")
mapper = TokenMapper(vocab, seed=7, block_tokens=16)
print(json.dumps([mapper.prompt([h, h + 1], 30) for h in range(50)]))
"""


def test_two_worker_processes_draw_identical_tokens() -> None:
    """Separate interpreters (different hash seeds, as on two Locust workers) agree."""
    outputs = []
    for hash_seed in ("1", "2"):
        env = os.environ | {"PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", _WORKER_SCRIPT],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )  # fmt: skip
        outputs.append(json.loads(done.stdout))
    expected = [make_mapper().prompt([h, h + 1], 30) for h in range(50)]
    assert outputs[0] == outputs[1] == expected


def test_vocabulary_from_tokenizer_excludes_special_added_tokens(tmp_path: Path) -> None:
    tokenizer = {
        "model": {"type": "BPE", "vocab": {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}},
        "added_tokens": [
            {"id": 0, "content": "<s>", "special": True},
            {"id": 1, "content": "</s>", "special": True},
            {"id": 5, "content": "<tool>", "special": False},
        ],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    vocabulary = vocabulary_from_tokenizer(tmp_path)
    assert vocabulary.allowed == (2, 3, 4, 5)
    assert vocabulary.special == {0, 1}


def test_unreadable_tokenizer_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(VocabularyError, match=r"tokenizer\.json: not valid JSON"):
        vocabulary_from_tokenizer(bad)


def test_vocabulary_of_only_special_tokens_is_refused() -> None:
    with pytest.raises(VocabularyError, match="no token ids left"):
        Vocabulary.build([0, 1], special=[0, 1], source="tiny")
