"""Block-pool overhead: vLLM's native LRU free queue against the plugin's policies.

The same generated request sequence (document QA, Zipf over documents, sequential) drives
vLLM's real ``BlockPool`` and the plugin's ``PolicyBlockPool`` (lru, arc, trio) through the
calls the KV cache manager makes: prefix lookup (``get_cached_block``), ``touch``,
``get_new_blocks``, ``cache_full_blocks``, ``free_blocks`` (tail first). Time per block
operation = CPU time of the whole replay / block operations (each looked-up, touched,
allocated, cached or freed block is one: 3 per prompt block whatever the policy decides); best
of ``repeats`` runs. All pools run in one process, taking turns within each repeat, each on a
fresh pool after a garbage collection. Time is the process's CPU time, not wall time: on a
shared machine another process taking the core would otherwise be charged to whichever pool ran
at that moment.

Native LRU and the plugin's LRU make the same decisions, so their ``hit_blocks`` are equal; the
plugin's side pays for what the KV cache manager wrappers do in vLLM (the ``_Allocation``).
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.request import Request

from arc_evictor.vllm_plugin.adapter import PolicyBlockPool, _Allocation


def _requests(count: int, block_size: int, seed: int) -> list[Request]:
    init_none_hash(sha256)
    rng = random.Random(seed)
    docs = [[rng.randrange(4, 30_000) for _ in range(8 * block_size)] for _ in range(200)]
    weights = [1 / (rank + 1) for rank in range(len(docs))]
    hasher = get_request_block_hasher(block_size, sha256)
    out = []
    for i in range(count):
        (doc,) = rng.choices(docs, weights)
        question = [rng.randrange(4, 30_000) for _ in range(2 * block_size)]
        out.append(
            Request(
                request_id=f"b{i}",
                prompt_token_ids=doc + question,
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    return out


def _replay(pool: BlockPool, requests: list[Request], block_size: int) -> tuple[float, int, int]:
    """Seconds, block operations and hit blocks of one sequential replay."""
    policy_pool = pool if isinstance(pool, PolicyBlockPool) else None
    ops = hits = 0
    started = time.process_time()
    for request in requests:
        hashes = request.block_hashes
        limit = (request.num_tokens - 1) // block_size  # the last token is always computed
        computed = []
        for block_hash in hashes[:limit]:
            found = pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            computed.append(found[0])
        pool.touch(computed)
        need = len(hashes) - len(computed)
        if policy_pool is not None:
            allocation = _Allocation(request)
            allocation.start, allocation.block_size = len(computed), block_size
            policy_pool.allocation = allocation
        new = pool.get_new_blocks(need)
        if policy_pool is not None:
            policy_pool.allocation = None
        blocks = computed + new
        pool.cache_full_blocks(request, blocks, len(computed), len(hashes), block_size, 0)
        pool.free_blocks(reversed(blocks))
        hits += len(computed)
        ops += len(computed) * 2 + need * 2 + len(blocks)
    return time.process_time() - started, ops, hits


def bench_block_pool(
    *,
    num_blocks: int = 1_000,
    requests: int = 4_000,
    block_size: int = 16,
    seed: int = 0,
    repeats: int = 5,
) -> list[dict[str, Any]]:
    """Rows: pool, policy, requests, block_ops, hit_blocks, ns_per_block_op, ratio_vs_native.

    The variants take turns within each repeat (native, lru, arc, trio, native, ...), so that a
    slower or busier stretch of the run falls on all of them alike.
    """
    workload = _requests(requests, block_size, seed)
    variants: list[tuple[str, str]] = [
        ("vllm-native", "lru"),
        ("plugin", "lru"),
        ("plugin", "arc"),
        ("plugin", "trio"),
    ]
    best: dict[tuple[str, str], tuple[float, int, int]] = {}
    for _ in range(repeats):
        for kind, policy in variants:
            if kind == "vllm-native":
                pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=block_size)
            else:
                pool = PolicyBlockPool(
                    num_blocks, enable_caching=True, hash_block_size=block_size, policy_name=policy
                )
            gc.collect()  # no run pays for the garbage of the one before
            seconds, ops, hits = _replay(pool, workload, block_size)
            if (kind, policy) not in best or seconds < best[kind, policy][0]:
                best[kind, policy] = (seconds, ops, hits)
    rows: list[dict[str, Any]] = []
    for kind, policy in variants:
        seconds, ops, hits = best[kind, policy]
        rows.append(
            {
                "pool": kind,
                "policy": policy,
                "requests": requests,
                "blocks": num_blocks,
                "block_ops": ops,
                "hit_blocks": hits,
                "ns_per_block_op": round(seconds / ops * 1e9, 1),
            }
        )
    native = rows[0]["ns_per_block_op"]
    for row in rows:
        row["ratio_vs_native"] = round(row["ns_per_block_op"] / native, 3)
    return rows


if __name__ == "__main__":
    for row in bench_block_pool():
        print(row)
