"""One streamed ``/v1/completions`` request: its body and the timing of its tokens.

Time to first token (TTFT) runs from the send to the first streamed chunk that carries a
token, not to the response headers, which a server may send before it has computed anything.
A chunk's tokens are counted exactly from vLLM's running usage (``continuous_usage_stats``:
every chunk carries the completion tokens so far), else from its ``token_ids``, else as one
token when it has text. The body does not ask for ``return_token_ids``: the vLLM router's
kv_aware policy (vllm-router 0.1.17) credits no cached prefix to a request that carries it,
so every such request is routed as if nothing were cached (docs/routing.md).

Inter-token latency (ITL) is the gap between chunks that carry tokens, spread evenly over the
chunk's tokens; tokens that arrive in the same chunk as the first token have no gap to measure
and add no ITL sample.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def completion_body(model: str, prompt: list[int], output_length: int) -> dict[str, Any]:
    """A request for exactly ``output_length`` tokens (at least 1: TTFT needs one)."""
    tokens = max(1, output_length)
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        # vLLM: usage on every chunk counts tokens exactly, whatever they decode to.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


class StreamError(ValueError):
    """The server's stream broke the OpenAI protocol or reported an error."""


@dataclass(slots=True)
class StreamStats:
    """Token timing of one stream, fed chunk by chunk with the time each arrived.

    Times are seconds on the caller's clock; ``sent`` is when the request left.
    """

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    def feed_line(self, line: bytes | str, now: float) -> bool:
        """Take one SSE line; returns False once the stream said ``[DONE]``."""
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        if not text.startswith("data:"):
            return True  # blank separators, comments and other SSE fields carry no tokens
        payload = text[len("data:") :].strip()
        if payload == "[DONE]":
            return False
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise StreamError(f"stream chunk is not JSON: {payload[:200]!r}") from None
        if "error" in chunk:
            raise StreamError(f"server error in stream: {chunk['error']}")
        self.feed_chunk(chunk, now)
        return True

    def feed_chunk(self, chunk: dict[str, Any], now: float) -> None:
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        so_far = (usage or {}).get("completion_tokens")
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            if ids is not None:
                count = len(ids)
            elif isinstance(so_far, int):
                count = so_far - self.tokens  # running usage: one choice per request
            else:
                count = int(bool(choice.get("text")))
            if count:
                if self.last_token is not None:
                    self.itl.extend([(now - self.last_token) / count] * count)
                else:
                    self.first_token = now
                self.last_token = now
                self.tokens += count
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def feed_lines(self, lines: Iterable[tuple[bytes | str, float]]) -> None:
        for line, now in lines:
            if not self.feed_line(line, now):
                return

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def output_tokens(self) -> int:
        """Tokens the server says it generated (usage), else the tokens counted."""
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.tokens

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens served from the prefix cache, if the server reports them."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return value if isinstance(value, int) else None
