"""A random scheduler-like workload over vLLM's real KVCacheManager, recorded step by step.

``drive`` admits requests (some with prompt logprobs, which skip prefix-cache reads), decodes
running requests a token at a time, frees them, now and then invalidates cached blocks, and
resets the prefix cache every 100 steps. Each step's record holds everything a KV cache
consumer can observe: the block ids handed out per group (in order), the hit per group, the
free-block count, the KV events (with their group index) and the reference count and hash of
every block. The random choices depend only on the seed and on what the manager reported, so
two managers that behave alike produce equal records.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from managers import make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request


@dataclass(frozen=True, slots=True)
class Step:
    """What a step did and what the manager reported."""

    action: str
    block_ids: tuple[tuple[int, ...], ...] | None  # new blocks per group; None: refused
    hit_ids: tuple[tuple[int, ...], ...]  # the committed prefix-cache hit per group
    hit_tokens: int
    free: int
    events: tuple[Any, ...]
    blocks: tuple[tuple[int, Any], ...]  # (ref_cnt, block_hash) of every block


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 30_000) for _ in range(count)]


def drive(
    manager: KVCacheManager,
    seed: int,
    steps: int,
    block_size: int,
    invalidate: bool = True,
    check: Callable[[], None] = lambda: None,
) -> list[Step]:
    """Run ``steps`` random steps; ``check`` runs after each (e.g. the pool's ``verify``)."""
    rng = random.Random(seed)
    pool = manager.block_pool
    docs = [tokens(seed * 1000 + i, rng.randint(1, 7) * block_size) for i in range(8)]
    running: list[Request] = []
    records: list[Step] = []
    for index in range(steps):
        roll = rng.random()
        hit_ids: tuple[tuple[int, ...], ...] = ()
        hit_tokens = 0
        block_ids: tuple[tuple[int, ...], ...] | None = ()
        if index % 100 == 99:
            action = "reset"
            for request in running:
                manager.free(request)
            running.clear()
            assert manager.reset_prefix_cache()
        elif roll < 0.35 or not running:
            prompt = list(rng.choice(docs)) + tokens(rng.randrange(10**6), rng.randint(0, 9))
            request = make_request(
                prompt, block_size, prompt_logprobs=rng.random() < 0.15, request_id=f"w{index}"
            )
            computed, hit_tokens, _ = manager.get_computed_blocks(request)
            new = manager.allocate_slots(
                request,
                request.num_tokens - hit_tokens,
                num_new_computed_tokens=hit_tokens,
                new_computed_blocks=computed,
            )
            action = "logprobs" if request.skip_reading_prefix_cache else "admit"
            hit_ids = tuple(map(tuple, computed.get_block_ids()))
            if new is None:
                block_ids = None
            else:
                block_ids = tuple(map(tuple, new.get_block_ids()))
                request.num_computed_tokens = request.num_tokens
                running.append(request)
        elif roll < 0.75:
            action = "decode"
            request = rng.choice(running)
            request.append_output_token_ids(rng.randrange(10, 30_000))
            new = manager.allocate_slots(request, 1)
            if new is None:
                block_ids = None
            else:
                block_ids = tuple(map(tuple, new.get_block_ids()))
                request.num_computed_tokens += 1
        elif roll < 0.97 or not invalidate:
            action = "free"
            manager.free(running.pop(rng.randrange(len(running))))
        else:
            action = "evict_blocks"
            cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
            manager.evict_blocks(set(rng.sample(cached, min(2, len(cached)))))
        check()
        records.append(
            Step(
                action=action,
                block_ids=block_ids,
                hit_ids=hit_ids,
                hit_tokens=hit_tokens,
                free=pool.get_num_free_blocks(),
                events=tuple(manager.take_events()),
                blocks=tuple((b.ref_cnt, b.block_hash) for b in pool.blocks),
            )
        )
    return records


def first_difference(expected: list[Step], got: list[Step]) -> str | None:
    """The first step where the records differ, described; None when they are equal."""
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:
            fields = [f for f in Step.__slots__ if getattr(want, f) != getattr(have, f)]
            return f"step {index} ({want.action}) differs in {fields}: {want!r} != {have!r}"
    return None
