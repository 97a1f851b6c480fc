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

For the plugin's pools the bench also times the policy's own share: the policy calls one replay
made (recorded in a run of its own, untimed) replayed alone on a fresh policy, per block
operation of the whole replay. The rest of a pool's time is the adapter's and vLLM's Python.

Native LRU and the plugin's LRU make the same decisions, so their ``hit_blocks`` are equal; the
plugin's side pays for what the KV cache manager wrappers do in vLLM (``get_new_blocks_for``
hands the pool the request's ``Allocation``). Pools and requests come from
``arc_evictor.vllm_plugin.block_pool``, so this module imports no vLLM internals.
"""

from __future__ import annotations

import gc
import itertools
import random
import time
from collections.abc import Callable
from typing import Any

from arc_evictor.policies import EvictionPolicy, make_policy
from arc_evictor.vllm_plugin.block_pool import (
    BlockPool,
    KVCacheBlock,
    PolicyBlockPool,
    Request,
    build_block_pool,
    get_new_blocks_for,
    request_builder,
)

# One policy call as made: the method's name and its arguments, sequences copied.
PolicyCall = tuple[str, tuple[Any, ...]]


class _RecordingPolicy:
    """Stands in for a pool's policy: forwards every call and records it, with copies of its
    list arguments."""

    def __init__(self, policy: EvictionPolicy, calls: list[PolicyCall]) -> None:
        self._policy = policy
        self._calls = calls
        self.capacity = policy.capacity

    def __len__(self) -> int:
        return len(self._policy)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._policy, name)

        def forward(*args: Any) -> Any:
            copied = tuple(list(arg) if isinstance(arg, list) else arg for arg in args)
            self._calls.append((name, copied))
            return method(*args)

        return forward


def document_qa_requests(count: int, block_size: int, seed: int) -> list[Request]:
    """vLLM requests: a Zipf-chosen 8-block document, then a 2-block question of its own."""
    build = request_builder(block_size)
    rng = random.Random(seed)
    docs = [[rng.randrange(4, 30_000) for _ in range(8 * block_size)] for _ in range(200)]
    weights = [1 / (rank + 1) for rank in range(len(docs))]
    out = []
    for i in range(count):
        (doc,) = rng.choices(docs, weights)
        question = [rng.randrange(4, 30_000) for _ in range(2 * block_size)]
        out.append(build(f"b{i}", doc + question))
    return out


def _replay(pool: BlockPool, requests: list[Request], block_size: int) -> tuple[float, int, int]:
    """Seconds, block operations and hit blocks of one sequential replay."""
    ops = hits = 0
    started = time.process_time()
    for request in requests:
        hashes = request.block_hashes
        limit = (request.num_tokens - 1) // block_size  # the last token is always computed
        computed: list[KVCacheBlock] = []
        for block_hash in hashes[:limit]:
            found = pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            computed.append(found[0])
        pool.touch(computed)
        need = len(hashes) - len(computed)
        new = get_new_blocks_for(pool, request, len(computed), block_size, need)
        blocks = computed + new
        pool.cache_full_blocks(request, blocks, len(computed), len(hashes), block_size, 0)
        pool.free_blocks(reversed(blocks))
        hits += len(computed)
        ops += len(computed) * 2 + need * 2 + len(blocks)
    return time.process_time() - started, ops, hits


def policy_calls(
    pool: PolicyBlockPool, block_size: int, workload: list[Request]
) -> list[PolicyCall]:
    """Every call ``pool`` makes to its policy during one replay of ``workload``."""
    calls: list[PolicyCall] = []
    pool.policy = _RecordingPolicy(pool.policy, calls)  # type: ignore[assignment]
    _replay(pool, workload, block_size)
    return calls


def replay_policy_calls(fresh: EvictionPolicy, calls: list[PolicyCall]) -> float:
    """Make ``calls`` to ``fresh``, nothing else running; their process CPU time."""
    serials = itertools.count(1)

    def copy_entry(key: Any) -> tuple[Any, int]:  # a further copy's entry, as the pool's
        return (key, next(serials))

    bound = [(name, getattr(fresh, name), args) for name, args in calls]
    gc.collect()
    started = time.process_time()
    for name, method, args in bound:
        if name == "allocate":
            method(args[0], args[1], copy_entry)
        else:
            method(*args)
    return time.process_time() - started


def bench_block_pool(
    *,
    num_blocks: int = 1_000,
    requests: int = 4_000,
    block_size: int = 16,
    seed: int = 0,
    repeats: int = 5,
) -> list[dict[str, Any]]:
    """Rows: pool, policy, requests, block_ops, hit_blocks, ns_per_block_op, ratio_vs_native,
    and for the plugin's pools policy_ns_per_block_op (the policy's own calls).

    The variants take turns within each repeat (native, lru, arc, trio, native, ...), so that a
    slower or busier stretch of the run falls on all of them alike.
    """
    workload = document_qa_requests(requests, block_size, seed)
    variants: list[tuple[str, str]] = [
        ("vllm-native", "lru"),
        ("plugin", "lru"),
        ("plugin", "arc"),
        ("plugin", "trio"),
    ]
    best: dict[tuple[str, str], tuple[float, int, int]] = {}
    calls: dict[str, list[PolicyCall]] = {}
    for kind, policy in variants:
        if kind == "plugin":
            pool = build_block_pool(num_blocks, block_size, policy)
            assert isinstance(pool, PolicyBlockPool)
            calls[policy] = policy_calls(pool, block_size, workload)
    policy_best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for kind, policy in variants:
            pool = build_block_pool(
                num_blocks, block_size, None if kind == "vllm-native" else policy
            )
            gc.collect()  # no run pays for the garbage of the one before
            seconds, ops, hits = _replay(pool, workload, block_size)
            if (kind, policy) not in best or seconds < best[kind, policy][0]:
                best[kind, policy] = (seconds, ops, hits)
            if kind == "plugin":
                fresh = make_policy(policy, num_blocks - 1)  # as the pool makes its own
                policy_seconds = replay_policy_calls(fresh, calls[policy])
                policy_best[policy] = min(policy_best[policy], policy_seconds)
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
                "policy_ns_per_block_op": (
                    round(policy_best[policy] / ops * 1e9, 1) if kind == "plugin" else None
                ),
            }
        )
    native = rows[0]["ns_per_block_op"]
    for row in rows:
        row["ratio_vs_native"] = round(row["ns_per_block_op"] / native, 3)
    return rows


if __name__ == "__main__":
    for row in bench_block_pool():
        print(row)
