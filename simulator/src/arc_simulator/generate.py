"""Workload generators with fixed seeds, written in either trace form.

A generated request is a list of segments (a shared system prompt, a document,
a question, a conversation turn), each a run of tokens with an identity. Block
ids follow from the segments and the form's block size:

- Mooncake form: a block's id stands for everything up to its end (a chain
  hash), so two requests share block i only if they share all tokens before it.
- Qwen-Bailian form: a block's id stands for its own tokens only (the reader
  re-keys them by chain).

Both are interned to small ints in first-seen order, so the same seed gives the
same file byte for byte.

Document QA (the published ARC-in-vLLM study's QuALITY/WikiQA setting): a pool
of documents, each asked a number of questions; each request draws its document
from a Zipf law over document ranks, so a few documents are hot and the long
tail streams through the cache once.

Multi-turn conversation: sessions arrive at random; each picks a shared system
prompt (Zipf over a few), and turn n+1's prompt is turn n's prompt, its answer
and a new user message; turns are separated by a think time. A share of the
sessions can open with one of a few popular first questions (Zipf), word for word.

The Mooncake form links no turns; each of its records carries the request's true
session (``true_session``: the conversation, or the question in document QA), a
field trace readers ignore, so a test can hold the sessions a reader infers
(``arc_serving_common.sessions``) to the truth.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arc_serving_common.traces import BLOCK_TOKENS, TraceFormatName, write_trace

Segment = tuple[str, int]  # (identity, tokens)
# Upper bounds on parameters, far above any real workload: a typo like 5000000000 documents
# is an error instead of hours of generating (and memory for each request).
MAX_COUNT = 1_000_000  # documents, sessions, system prompts, turns per session
MAX_TOKENS = 1_000_000  # tokens of one segment (a document, a prompt, an answer)
MAX_REQUESTS = 10_000_000


@dataclass(frozen=True, slots=True)
class GeneratedRequest:
    timestamp_s: float
    segments: tuple[Segment, ...]
    output_length: int
    chat_id: int
    session: int  # the conversation (document QA: the question) the request belongs to
    parent_id: int | None = None
    turn: int = 1

    @property
    def input_length(self) -> int:
        return sum(tokens for _, tokens in self.segments)


@dataclass(frozen=True, slots=True)
class DocQAParams:
    """Document QA: by default about 400 documents of about 5,000 tokens, about 18
    questions each, Zipf over documents (the published ARC-in-vLLM study's shape)."""

    documents: int = 400
    document_tokens: int = 5_000
    questions_per_document: float = 18.0
    zipf_exponent: float = 0.8
    question_tokens: int = 40
    system_tokens: int = 0
    output_tokens: int = 64
    requests_per_second: float = 4.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ConversationParams:
    """Multi-turn chat: sessions, shared system prompts, think time between turns.

    ``first_user_tokens`` is the mean length of a session's first question (0: ``user_tokens``);
    a share ``popular_first_share`` of the sessions asks, as its first question, one of
    ``popular_questions`` questions (Zipf), the same tokens in every session that asks it.
    """

    sessions: int = 400
    system_prompts: int = 8
    system_tokens: int = 1_000
    mean_turns: float = 4.0  # at least 1; capped by max_turns
    max_turns: int = 12
    user_tokens: int = 200
    first_user_tokens: int = 0
    popular_first_share: float = 0.0
    popular_questions: int = 20
    output_tokens: int = 150
    think_time_s: float = 20.0
    sessions_per_second: float = 1.0
    seed: int = 0


def _check_positive(params: Any, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(params, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_at_most(params: Any, names: Sequence[str], limit: int) -> None:
    for name in names:
        value = getattr(params, name)
        if not value <= limit:
            raise ValueError(f"{name} must be at most {limit:,}, got {value}")


def _zipf_sampler(rng: random.Random, n: int, exponent: float) -> list[float]:
    weights = [1.0 / (rank**exponent) for rank in range(1, n + 1)]
    total = sum(weights)
    cumulative = []
    running = 0.0
    for weight in weights:
        running += weight / total
        cumulative.append(running)
    return cumulative


def _draw(rng: random.Random, cumulative: list[float]) -> int:
    point = rng.random()
    low, high = 0, len(cumulative) - 1
    while low < high:
        middle = (low + high) // 2
        if cumulative[middle] < point:
            low = middle + 1
        else:
            high = middle
    return low


def _vary(rng: random.Random, mean: int) -> int:
    """A length around ``mean`` (uniform in [mean/2, 3*mean/2]), at least 1."""
    return max(1, round(mean * rng.uniform(0.5, 1.5)))


def docqa(params: DocQAParams) -> list[GeneratedRequest]:
    """Document-QA requests, Zipf over documents, Poisson arrivals."""
    _check_positive(params, ("documents", "document_tokens", "questions_per_document"))
    _check_positive(params, ("question_tokens", "output_tokens", "requests_per_second"))
    if not (params.zipf_exponent >= 0 and math.isfinite(params.zipf_exponent)):
        raise ValueError(f"zipf_exponent must be a finite number >= 0, got {params.zipf_exponent}")
    if params.system_tokens < 0:
        raise ValueError(f"system_tokens must be >= 0, got {params.system_tokens}")
    _check_at_most(params, ("documents",), MAX_COUNT)
    _check_at_most(params, ("document_tokens", "question_tokens", "system_tokens"), MAX_TOKENS)
    _check_at_most(params, ("output_tokens",), MAX_TOKENS)
    if params.documents * params.questions_per_document > MAX_REQUESTS:
        raise ValueError(
            f"documents * questions_per_document must be at most {MAX_REQUESTS:,}, got "
            f"{params.documents * params.questions_per_document:,.0f}"
        )
    rng = random.Random(params.seed)
    lengths = [_vary(rng, params.document_tokens) for _ in range(params.documents)]
    # Popularity rank is independent of document id, as in a real corpus.
    ranks = list(range(params.documents))
    rng.shuffle(ranks)
    cumulative = _zipf_sampler(rng, params.documents, params.zipf_exponent)
    total = round(params.documents * params.questions_per_document)
    requests = []
    now = 0.0
    for index in range(total):
        now += rng.expovariate(params.requests_per_second)
        document = ranks[_draw(rng, cumulative)]
        segments: list[Segment] = []
        if params.system_tokens:
            segments.append(("system", params.system_tokens))
        segments.append((f"doc{document}", lengths[document]))
        segments.append((f"question{index}", _vary(rng, params.question_tokens)))
        requests.append(
            GeneratedRequest(now, tuple(segments), _vary(rng, params.output_tokens), index, index)
        )
    return requests


def conversation(params: ConversationParams) -> list[GeneratedRequest]:
    """Multi-turn sessions; every turn extends the previous turn's context."""
    _check_positive(params, ("sessions", "system_prompts", "system_tokens", "mean_turns"))
    _check_positive(params, ("max_turns", "user_tokens", "output_tokens", "sessions_per_second"))
    if not (params.think_time_s >= 0 and math.isfinite(params.think_time_s)):
        raise ValueError(f"think_time_s must be a finite number >= 0, got {params.think_time_s}")
    _check_positive(params, ("popular_questions",))
    if params.first_user_tokens < 0:
        raise ValueError(f"first_user_tokens must be >= 0, got {params.first_user_tokens}")
    if not 0 <= params.popular_first_share <= 1:
        raise ValueError(
            f"popular_first_share must be between 0 and 1, got {params.popular_first_share}"
        )
    _check_at_most(params, ("sessions", "system_prompts", "max_turns"), MAX_COUNT)
    _check_at_most(params, ("popular_questions",), MAX_COUNT)
    _check_at_most(params, ("system_tokens", "user_tokens", "output_tokens"), MAX_TOKENS)
    _check_at_most(params, ("first_user_tokens",), MAX_TOKENS)
    if params.sessions * min(params.max_turns, params.mean_turns) > MAX_REQUESTS:
        raise ValueError(f"sessions * min(max_turns, mean_turns) must be at most {MAX_REQUESTS:,}")
    rng = random.Random(params.seed)
    cumulative = _zipf_sampler(rng, params.system_prompts, 1.0)
    first_tokens = params.first_user_tokens or params.user_tokens
    # Drawn only when asked for, so the same seed gives the same trace as before without them.
    popular: list[Segment] = []
    popularity: list[float] = []
    if params.popular_first_share > 0:
        popular = [
            (f"popular{n}", _vary(rng, first_tokens)) for n in range(params.popular_questions)
        ]
        popularity = _zipf_sampler(rng, params.popular_questions, 1.0)
    requests = []
    chat_id = 0
    start = 0.0
    for session in range(params.sessions):
        start += rng.expovariate(params.sessions_per_second)
        # Geometric turn count (another turn with probability 1 - 1/mean_turns): mean
        # mean_turns before the max_turns cap.
        turns = 1
        while turns < params.max_turns and rng.random() >= 1 / params.mean_turns:
            turns += 1
        context: list[Segment] = [(f"system{_draw(rng, cumulative)}", params.system_tokens)]
        now = start
        parent = None
        for turn in range(1, turns + 1):
            if turn == 1 and popular and rng.random() < params.popular_first_share:
                context.append(popular[_draw(rng, popularity)])
            else:
                mean = first_tokens if turn == 1 else params.user_tokens
                context.append((f"s{session}user{turn}", _vary(rng, mean)))
            output = _vary(rng, params.output_tokens)
            requests.append(
                GeneratedRequest(now, tuple(context), output, chat_id, session, parent, turn)
            )
            context.append((f"s{session}answer{turn}", output))
            parent = chat_id
            chat_id += 1
            now += rng.expovariate(1.0 / params.think_time_s) if params.think_time_s else 0.0
    requests.sort(key=lambda request: request.timestamp_s)
    return requests


class _BlockIds:
    """Turns segment lists into block ids for one trace form, interning ids."""

    def __init__(self, fmt: TraceFormatName, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.fmt = fmt
        self.block_tokens = block_tokens
        self._ids: dict[tuple[Any, ...], int] = {}

    def block_ids(self, segments: Sequence[Segment]) -> list[int]:
        # Pieces: (segment identity, first token, last token) inside each block.
        ids = []
        prefix: tuple[Any, ...] = ()
        block: list[tuple[str, int, int]] = []
        filled = 0
        for identity, tokens in segments:
            offset = 0
            while offset < tokens:
                take = min(tokens - offset, self.block_tokens - filled)
                block.append((identity, offset, offset + take))
                offset += take
                filled += take
                if filled == self.block_tokens:
                    prefix = self._emit(ids, prefix, block)
                    block, filled = [], 0
        if block:
            self._emit(ids, prefix, block)
        return ids

    def _emit(
        self, ids: list[int], prefix: tuple[Any, ...], block: list[tuple[str, int, int]]
    ) -> tuple[Any, ...]:
        content = tuple(block)
        identity = (prefix, content) if self.fmt == "mooncake" else content
        block_id = self._ids.setdefault(identity, len(self._ids))
        ids.append(block_id)
        return (block_id,) if self.fmt == "mooncake" else ()


def to_records(
    requests: Sequence[GeneratedRequest], fmt: TraceFormatName, block_tokens: int | None = None
) -> Iterator[dict[str, Any]]:
    """Trace records (JSON objects) of ``requests`` in form ``fmt``."""
    blocks = _BlockIds(fmt, BLOCK_TOKENS[fmt] if block_tokens is None else block_tokens)
    for request in requests:
        ids = blocks.block_ids(request.segments)
        if fmt == "mooncake":
            yield {
                "timestamp": round(request.timestamp_s * 1000),
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": ids,
                "true_session": request.session,
            }
        else:
            yield {
                "chat_id": request.chat_id,
                "parent_chat_id": -1 if request.parent_id is None else request.parent_id,
                "timestamp": round(request.timestamp_s, 3),
                "input_length": request.input_length,
                "output_length": request.output_length,
                "type": "text",
                "turn": request.turn,
                "hash_ids": ids,
            }


def write_generated(
    path: str | Path,
    requests: Sequence[GeneratedRequest],
    fmt: TraceFormatName,
    block_tokens: int | None = None,
) -> int:
    """Write ``requests`` as a trace file; returns the number of requests.

    Bad parameters raise ValueError before the file is opened.
    """
    if block_tokens is not None and block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    return write_trace(path, to_records(requests, fmt, block_tokens))
