"""Builders for the unit tests: vLLM's real KVCacheManager over a PolicyBlockPool or vLLM's own.

``kv_cache_config`` builds the KV cache layouts the tests drive, the way vLLM's own
``tests/v1/core/test_prefix_caching.py`` does (``make_kv_cache_config_hybrid_model``): one group
per attention type, each with its own layer. ``admit`` plays the scheduler's part for one
request: it looks up the prefix cache, then allocates slots for the whole prompt.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool

init_none_hash(sha256)
_ids = itertools.count()


# Layouts the plugin drives, by name: the attention type of each KV cache group, ``*k`` for a
# group whose blocks are k times the base block size (page sizes differ, e.g. by KV dtype or
# head count). vLLM then hashes at the gcd of the group block sizes, so a full-attention group
# with larger blocks also caches the prompt's partial last block (``cache_partial_block``).
SUPPORTED_LAYOUTS = (
    "full",
    "swa",
    "full+swa",
    "full+chunked",
    "full+swa+chunked",
    "full*2+swa",
    "full*4+swa",
    "full+swa*2",
)
REFUSED_LAYOUTS = ("full+mamba",)


def group_spec(kind: str, block_size: int) -> KVCacheSpec:
    """One group's spec, as vLLM's tests build them: 1 head of 32, windows of 2 and 4 blocks."""
    common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 32, "dtype": torch.float32}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "swa":
        return SlidingWindowSpec(**common, sliding_window=2 * block_size)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=4 * block_size)
    if kind == "mamba":
        return MambaSpec(
            block_size=block_size,
            shapes=((1, 32),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",  # vLLM 0.33 caches Mamba state only in this mode
        )
    raise ValueError(f"unknown group kind {kind!r}: expected full, swa, chunked or mamba")


def group_block_sizes(block_size: int, layout: str) -> list[tuple[str, int]]:
    """(kind, block size) of each ``+``-separated group of ``layout`` (``kind*k``: k blocks)."""
    groups = []
    for group in layout.split("+"):
        kind, _, times = group.partition("*")
        groups.append((kind, block_size * int(times or 1)))
    return groups


def kv_cache_config(num_blocks: int, block_size: int, layout: str = "full") -> KVCacheConfig:
    """A KV cache config with one group per ``+``-separated kind of ``layout``."""
    groups = [
        KVCacheGroupSpec([f"layer.{i}"], group_spec(kind, size))
        for i, (kind, size) in enumerate(group_block_sizes(block_size, layout))
    ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@contextmanager
def stock_pools() -> Iterator[None]:
    """Managers built inside get vLLM's own BlockPool (the plugin stays installed)."""
    patched = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = BlockPool  # type: ignore[misc]
    try:
        yield
    finally:
        kv_cache_coordinator.BlockPool = patched  # type: ignore[misc]


def make_manager(
    policy: str | None,
    num_blocks: int,
    block_size: int = 4,
    layout: str = "full",
    events: bool = False,
) -> KVCacheManager:
    """A real KVCacheManager whose pool evicts by ``policy`` (the plugin installed), or
    vLLM's own pool for ``policy=None``; ``events`` turns vLLM's KV cache events on.

    As vLLM's scheduler does, requests are hashed at the gcd of the group block sizes and
    scheduled (and cached) at their lcm; with one block size both are ``block_size``."""
    sizes = [size for _, size in group_block_sizes(block_size, layout)]
    kwargs = {
        "max_model_len": num_blocks * block_size,
        "scheduler_block_size": math.lcm(*sizes),
        "hash_block_size": math.gcd(*sizes),
        "enable_caching": True,
        "enable_kv_cache_events": events,
    }
    config = kv_cache_config(num_blocks, block_size, layout)
    if policy is None:
        with stock_pools():
            manager = KVCacheManager(config, **kwargs)
        assert not isinstance(manager.block_pool, PolicyBlockPool)
        return manager
    patches.set_policy_name(policy)
    manager = KVCacheManager(config, **kwargs)
    assert isinstance(manager.block_pool, PolicyBlockPool)
    return manager


def make_request(
    tokens: Sequence[int], block_size: int, prompt_logprobs: bool = False, request_id: str = ""
) -> Request:
    """A request for ``tokens``; with ``prompt_logprobs`` vLLM skips reading the prefix cache."""
    sampling = SamplingParams(max_tokens=1, prompt_logprobs=1 if prompt_logprobs else None)
    return Request(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def admit(manager: KVCacheManager, request: Request) -> int | None:
    """Look up, then allocate the whole prompt; the number of hit blocks, or None if no room."""
    computed, num_computed_tokens, _ = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_computed_tokens
    blocks = manager.allocate_slots(
        request,
        num_new,
        num_new_computed_tokens=num_computed_tokens,
        new_computed_blocks=computed,
    )
    if blocks is None:
        return None
    request.num_computed_tokens = request.num_tokens
    return num_computed_tokens // manager.block_pool.hash_block_size
