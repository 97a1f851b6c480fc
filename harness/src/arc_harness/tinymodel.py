"""A tiny Llama that vLLM can serve, built locally: random weights, a locally trained tokenizer.

Tests, the demo and the load test need a real model directory for the real vLLM server, and
nothing may be downloaded. ``build_tiny_llama`` writes a Hugging Face model directory
(``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files)
whose weights come from a seeded generator and whose tokenizer is a WordLevel model trained
with HF ``tokenizers`` on seeded generated text. The output is nonsense; what matters is that
vLLM loads it, its KV blocks are real, and token-id prompts map one id per token.

Sizes are chosen for vLLM's CPU build: the CPU attention backend needs a head size in
{32, 64, 80, ...}, so hidden 128 with 4 heads gives head size 32; ``max_position_embeddings``
of 4096 lets traces send long prompts.

Invariant: a directory is reused only when its stamp file records the same build parameters
(including the seed), so a reused model is byte-for-byte what a fresh build would produce.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

# Special tokens, in id order: ids 0..3 are reserved, every other id is an ordinary word.
SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")
STAMP_FILE = "arc-tinymodel.json"
# A minimal chat template so /v1/chat/completions works (vLLM needs one for chat requests).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _words(seed: int, vocab_size: int) -> list[str]:
    """``vocab_size`` distinct pronounceable words from a seeded generator."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < vocab_size:
        syllables = rng.randint(1, 3)
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables)))
    return sorted(words)


def _corpus(words: list[str], seed: int, lines: int) -> Iterator[str]:
    """Seeded text in which every word occurs (so the trained vocabulary is all of them)."""
    rng = random.Random(seed + 1)
    yield " ".join(words)
    for _ in range(lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))


def _train_tokenizer(out_dir: Path, *, seed: int, vocab_size: int) -> int:
    """Train and save the tokenizer; returns the full vocabulary size (specials included)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words = _words(seed, vocab_size - len(SPECIAL_TOKENS))
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS)
    )
    tokenizer.train_from_iterator(_corpus(words, seed, lines=2000), trainer=trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return tokenizer.get_vocab_size()


def _write_model(
    out_dir: Path,
    *,
    seed: int,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    max_positions: int,
) -> None:
    """Write config.json, generation_config.json and seeded random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=SPECIAL_TOKENS.index("<s>"),
        eos_token_id=SPECIAL_TOKENS.index("</s>"),
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)


def build_tiny_llama(
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 4096,
) -> Path:
    """Build (or reuse) a tiny Llama model directory at ``out_dir`` and return its path.

    Reuses ``out_dir`` when its stamp records the same parameters; otherwise writes the
    model into a sibling temporary directory and renames it into place, so a crash never
    leaves a half-built model that a later call would reuse.
    """
    if vocab_size <= len(SPECIAL_TOKENS) + 16:
        raise ValueError(f"vocab_size must be more than {len(SPECIAL_TOKENS) + 16}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 32:
        raise ValueError(
            f"hidden_size/num_heads must be a multiple of 32 (vLLM's CPU attention head sizes),"
            f" got {hidden_size}/{num_heads}"
        )
    if num_layers < 1 or max_positions < 64:
        raise ValueError("num_layers must be >= 1 and max_positions >= 64")
    out_dir = Path(out_dir)
    params = {
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "max_positions": max_positions,
    }
    stamp = out_dir / STAMP_FILE
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not stamp.is_file():
        raise FileExistsError(
            f"{out_dir} exists and is not a tiny-model directory; not touching it"
        )

    tmp = out_dir.with_name(out_dir.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    full_vocab = _train_tokenizer(tmp, seed=seed, vocab_size=vocab_size)
    _write_model(
        tmp,
        seed=seed,
        vocab_size=full_vocab,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        max_positions=max_positions,
    )
    (tmp / STAMP_FILE).write_text(json.dumps(params, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def special_token_ids() -> tuple[int, ...]:
    """Ids a prompt generator should avoid (bos, eos, pad, unk): always 0..3 here."""
    return tuple(range(len(SPECIAL_TOKENS)))


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m arc_harness.tinymodel OUT_DIR [--seed N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m arc_harness.tinymodel",
        description="Build a tiny random-weight Llama with a locally trained tokenizer.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)
    try:
        path = build_tiny_llama(args.out_dir, seed=args.seed, vocab_size=args.vocab_size)
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
