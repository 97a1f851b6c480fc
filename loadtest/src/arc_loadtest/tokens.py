"""Trace blocks to prompt token ids, the same on every Locust worker.

A trace names each block of a prompt by a hash id. The replay turns hash id ``h`` into
``block_tokens`` token ids drawn by ``numpy.random.default_rng([seed, h])`` from the served
model's vocabulary minus its special tokens (docs/architecture.md, "Traces"). The draw
depends only on (seed, hash id, block size, vocabulary), so two workers, two runs or the
simulator's view of the same trace agree on which prompts share a prefix, and two requests
that share their first k hash ids share their first k blocks of tokens exactly, which is
what the server's prefix cache sees. Prompts are sent as token-id lists, so no tokenizer
round trip can change them.

The vocabulary comes from the model's ``tokenizer.json`` (exact) or, when only the server is
at hand, from its tokenizer endpoints (see ``vocabulary_from_server``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class VocabularyError(ValueError):
    """The vocabulary could not be read or leaves no usable token."""


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The token ids prompts are drawn from.

    Invariant: ``allowed`` is sorted, duplicate-free, non-empty and holds no id in ``special``.
    """

    allowed: tuple[int, ...]
    special: frozenset[int]
    source: str  # where it came from, for logs and the summary

    @classmethod
    def build(cls, ids: Iterable[int], special: Iterable[int], source: str) -> Vocabulary:
        special_ids = frozenset(special)
        allowed = tuple(sorted(set(ids) - special_ids))
        if not allowed:
            raise VocabularyError(f"{source}: no token ids left after removing special tokens")
        if allowed[0] < 0:
            raise VocabularyError(f"{source}: negative token id {allowed[0]}")
        return cls(allowed=allowed, special=special_ids, source=source)

    def fingerprint(self) -> str:
        """A short digest of the allowed ids: equal fingerprints draw equal tokens."""
        digest = hashlib.sha256(np.asarray(self.allowed, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]


class TokenMapper:
    """Maps hash ids to blocks of token ids and traces' requests to prompts.

    Invariant: ``block(h)`` is a pure function of (seed, h, block_tokens, vocabulary); the
    cache only saves recomputing it and is bounded by ``cache_blocks``.
    """

    def __init__(
        self, vocabulary: Vocabulary, *, seed: int, block_tokens: int, cache_blocks: int = 8192
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.vocabulary = vocabulary
        self.seed = seed
        self.block_tokens = block_tokens
        self._allowed = np.asarray(vocabulary.allowed, dtype=np.int64)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_blocks = cache_blocks

    def block(self, hash_id: int) -> np.ndarray:
        """The ``block_tokens`` token ids of hash id ``hash_id`` (read-only array)."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        if hash_id < 0:
            raise ValueError(f"hash ids must be >= 0, got {hash_id}")
        rng = np.random.default_rng([self.seed, hash_id])
        tokens = self._allowed[rng.integers(0, len(self._allowed), size=self.block_tokens)]
        tokens.flags.writeable = False
        self._cache[hash_id] = tokens
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return tokens

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        """The prompt of a request: its blocks in order, the last one trimmed to fit.

        The trace guarantees ``len(hash_ids) == ceil(input_length / block_tokens)`` for the
        block size it was read with; a shorter id list is an error, never silent padding.
        """
        if input_length > len(hash_ids) * self.block_tokens:
            raise ValueError(
                f"input_length {input_length} needs more than {len(hash_ids)} blocks of "
                f"{self.block_tokens} tokens"
            )
        blocks = [self.block(h) for h in hash_ids]
        return np.concatenate(blocks)[:input_length].tolist() if blocks else []

    def fingerprint(self) -> str:
        """Digest of everything the mapping depends on (compare workers with it)."""
        return f"{self.seed}-{self.block_tokens}-{self.vocabulary.fingerprint()}"


def vocabulary_from_tokenizer(path: str | Path) -> Vocabulary:
    """The vocabulary of a Hugging Face ``tokenizer.json`` (or a folder holding one).

    Every id of the model's vocabulary and of the added tokens is allowed, except added
    tokens marked ``"special": true``.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise VocabularyError(f"{file}: cannot read tokenizer ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise VocabularyError(f"{file}: not valid JSON ({error.msg})") from None
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        ids = [int(i) for i in vocab.values()]
    elif isinstance(vocab, list):  # Unigram: a list of [piece, score], ids are positions
        ids = list(range(len(vocab)))
    else:
        raise VocabularyError(f"{file}: no model.vocab in this tokenizer.json")
    special: set[int] = set()
    for token in data.get("added_tokens") or []:
        ids.append(int(token["id"]))
        if token.get("special"):
            special.add(int(token["id"]))
    return Vocabulary.build(ids, special, source=str(file))


class JsonClient(Protocol):
    """What ``vocabulary_from_server`` needs: POST/GET returning (status, JSON body)."""

    def get_json(self, path: str) -> tuple[int, Any]: ...

    def post_json(self, path: str, body: dict[str, Any]) -> tuple[int, Any]: ...


def vocabulary_from_server(
    client: JsonClient, model: str, *, max_probe: int = 1 << 24
) -> Vocabulary:
    """The vocabulary a vLLM server accepts, read through its endpoints.

    Size: the smallest id a one-token ``/v1/completions`` request is rejected for as out of
    vocabulary (HTTP 400; doubling, then bisection: about 2 log2(V) one-token requests, made
    before the run's counters are read; ``/detokenize`` accepts any id). Special ids: those
    ``/tokenize`` adds around a text (BOS/EOS), plus, when the server runs with
    ``--enable-tokenizer-info-endpoint``, every special or added token ``/tokenizer_info``
    names. Without that endpoint, special tokens
    that the tokenizer never adds (e.g. padding) cannot be seen: pass ``--tokenizer`` for an
    exact list.
    """

    def accepted(token_id: int) -> bool:
        body = {"model": model, "prompt": [token_id], "max_tokens": 1}
        status, _ = client.post_json("/v1/completions", body)
        if status == 200:
            return True
        if status == 400:
            return False
        raise VocabularyError(f"/v1/completions answered HTTP {status} for token id {token_id}")

    if not accepted(0):
        raise VocabularyError(f"the server rejects token id 0 for model {model!r}")
    low, high = 0, 1024  # invariant: low accepted; high rejected once found
    while accepted(high):
        low, high = high, high * 2
        if high > max_probe:
            raise VocabularyError(f"the server accepts token ids beyond {max_probe}")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepted(middle) else (low, middle)
    special = _special_ids_from_server(client, model)
    return Vocabulary.build(range(high), special, source=f"server ({high} ids)")


def _tokenize(client: JsonClient, model: str, text: str, add_special: bool) -> list[int]:
    body = {"model": model, "prompt": text, "add_special_tokens": add_special}
    status, data = client.post_json("/tokenize", body)
    if status != 200:
        raise VocabularyError(f"/tokenize answered HTTP {status}: {data}")
    return [int(t) for t in data["tokens"]]


def _special_ids_from_server(client: JsonClient, model: str) -> set[int]:
    plain = _tokenize(client, model, "a", add_special=False)
    special = set(_tokenize(client, model, "a", add_special=True)) - set(plain)
    status, info = client.get_json("/tokenizer_info")
    if status != 200 or not isinstance(info, dict):
        return special
    names: set[str] = set()
    for key, value in info.items():
        if key.endswith("_token") and isinstance(value, str):
            names.add(value)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        if isinstance(info.get(key), list):
            names.update(v for v in info[key] if isinstance(v, str))
    decoder = info.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        special.update(int(i) for i in decoder if str(i).isdigit())
    for name in names:
        ids = _tokenize(client, model, name, add_special=False)
        if len(ids) == 1:  # a special token tokenizes to itself; anything else is text
            special.add(ids[0])
    return special
