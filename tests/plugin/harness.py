"""Builders for the unit tests: vLLM's real KVCacheManager over a PolicyBlockPool.

``Engine`` plays the scheduler's part for one request at a time or several at once: it looks
up the prefix cache, allocates slots for the whole prompt, caches the blocks, then frees.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool

init_none_hash(sha256)
_ids = itertools.count()


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )


def make_manager(policy: str, num_blocks: int, block_size: int = 4) -> KVCacheManager:
    """A real KVCacheManager whose pool evicts by ``policy`` (the plugin installed)."""
    patches.set_policy_name(policy)
    manager = KVCacheManager(
        kv_cache_config(num_blocks, block_size),
        max_model_len=num_blocks * block_size,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
    )
    assert isinstance(manager.block_pool, PolicyBlockPool)
    return manager


def make_request(tokens: Sequence[int], block_size: int) -> Request:
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
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
