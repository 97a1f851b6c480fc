"""The plugin's cost per scheduler step and per cached block, at a GPU server's pool size.

A serving-scale stream runs through vLLM 0.32's real ``KVCacheManager`` as its scheduler drives
it, with ``batch`` requests running at once: every step, each running request decodes one token
(``allocate_slots`` for that token: a new block every 16 tokens, each block cached as it
fills), the requests that produced their last token are freed (``free``), and new requests are
admitted until the batch is full again (``get_computed_blocks``, then ``allocate_slots`` for the
whole prompt, which touches the hit blocks and caches the prompt's full blocks). What a step
costs is the process CPU time of those manager calls, measured step by step after a warm-up
that fills the pool and evicts from it; the model's forward pass is absent, so the figures are
the manager's share of a step only.

The stream is document QA at scale: 1,024-token documents drawn from a Zipf law over far more
documents than the pool holds, a 64-token question of its own, 64-256 output tokens. vLLM's own
pool (its LRU free queue, with no plugin code on any path: the plugin's manager wrappers are
lifted for it) runs the same stream as the plugin's ``lru``, ``arc`` and ``trio``, taking turns
within each repeat.

Memory: after the same warm-up, the bytes of every object the plugin holds and vLLM does not
(the policy's lists and counts, ARC's ghost lists and the block hashes they keep alive, the
adapter's maps), over the pool's blocks.
"""

from __future__ import annotations

import gc
import random
import sys
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator, kv_cache_manager, single_type_kv_cache_manager
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool

BLOCK_TOKENS = 16
NATIVE = "vllm-native"
PLUGIN_POLICIES = ("lru", "arc", "trio")
STEP_BUDGET_S = 0.010  # the engine step the added time is compared with
DOCUMENT_TOKENS = 1_024
QUESTION_TOKENS = 64
OUTPUT_TOKENS = (64, 256)  # uniform in this range
ZIPF_EXPONENT = 1.1
# KV memory of one 16-token block (bf16 keys and values, every layer): 2 x layers x KV heads
# x head size x 2 bytes x 16 tokens.
MODEL_BLOCK_BYTES = {
    "Llama-3.1-8B (32 layers, 8 KV heads of 128)": 2 * 32 * 8 * 128 * 2 * BLOCK_TOKENS,
    "Qwen2.5-7B (28 layers, 4 KV heads of 128)": 2 * 28 * 4 * 128 * 2 * BLOCK_TOKENS,
}


@dataclass(frozen=True, slots=True)
class StepSettings:
    """One configuration: the pool, the batch, and how many steps to warm up and to time."""

    num_blocks: int
    batch: int
    warmup_steps: int
    timed_steps: int
    seed: int = 0

    @property
    def documents(self) -> int:
        """Four times the documents the pool holds: the cache must choose."""
        return 4 * self.num_blocks * BLOCK_TOKENS // DOCUMENT_TOKENS


@dataclass(frozen=True, slots=True)
class StepResult:
    """One pool's replay: per-step CPU times of the timed steps and what they did."""

    pool: str
    step_seconds: list[float]
    block_ops: int  # blocks looked up and hit, allocated, cached or freed in the timed steps
    hit_blocks: int
    queried_blocks: int

    @property
    def mean_us(self) -> float:
        return 1e6 * sum(self.step_seconds) / len(self.step_seconds)

    @property
    def p99_us(self) -> float:
        ordered = sorted(self.step_seconds)
        return 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


def _plugin_patches() -> list[tuple[Any, str]]:
    """Every vLLM attribute the plugin's ``patches.install`` replaces on the manager's paths."""
    return [
        (kv_cache_manager.KVCacheManager, "__init__"),
        (kv_cache_manager.KVCacheManager, "allocate_slots"),
        (single_type_kv_cache_manager.SingleTypeKVCacheManager, "allocate_new_blocks"),
    ]


@contextmanager
def stock_vllm() -> Iterator[None]:
    """vLLM as shipped: the plugin's wrappers lifted (each keeps the original as
    ``__wrapped__``) and vLLM's own ``BlockPool`` built, for the native rows."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _plugin_patches()]
    saved_pool = kv_cache_coordinator.BlockPool
    try:
        for owner, name, patched in saved:
            setattr(owner, name, patched.__wrapped__)
        kv_cache_coordinator.BlockPool = BlockPool  # type: ignore[misc]
        yield
    finally:
        for owner, name, patched in saved:
            setattr(owner, name, patched)
        kv_cache_coordinator.BlockPool = saved_pool  # type: ignore[misc]


def make_manager(pool: str, num_blocks: int, max_model_len: int) -> KVCacheManager:
    """A real KVCacheManager of ``num_blocks`` 16-token blocks of one full-attention group:
    vLLM's own pool for ``NATIVE``, else the plugin's evicting by policy ``pool``."""
    patches.install(PLUGIN_POLICIES[0], on_step=lambda: None, on_pool=lambda built: None)
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=32,
                             dtype=torch.float32)  # fmt: skip
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])  # fmt: skip
    kwargs: dict[str, Any] = {"max_model_len": max_model_len, "scheduler_block_size": BLOCK_TOKENS,
                              "hash_block_size": BLOCK_TOKENS, "enable_caching": True}  # fmt: skip
    if pool == NATIVE:
        with stock_vllm():
            manager = KVCacheManager(config, **kwargs)
        assert type(manager.block_pool) is BlockPool, "the native row runs a plugin pool"
        return manager
    patches.set_policy_name(pool)
    manager = KVCacheManager(config, **kwargs)
    assert isinstance(manager.block_pool, PolicyBlockPool), "the plugin did not build the pool"
    return manager


class RequestStream:
    """The document-QA requests of one seed, the same for every pool."""

    def __init__(self, settings: StepSettings) -> None:
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
        self._rng = random.Random(settings.seed)
        self._weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(settings.documents)]
        self._documents = range(settings.documents)
        self._count = 0

    def next(self) -> tuple[Request, int]:
        """The next request and its output length."""
        rng = self._rng
        (document,) = rng.choices(self._documents, self._weights)
        # A document's tokens follow from its number alone: no table of 400,000 documents.
        first = 4 + document * 7919 % 30_000
        prompt = [(first + i) % 30_000 + 4 for i in range(DOCUMENT_TOKENS)]
        prompt += [rng.randrange(4, 30_004) for _ in range(QUESTION_TOKENS)]
        self._count += 1
        request = Request(
            request_id=f"s{self._count}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=OUTPUT_TOKENS[1]),
            pooling_params=None,
            block_hasher=self._hasher,
        )
        return request, rng.randint(*OUTPUT_TOKENS)


def replay(
    pool: str, settings: StepSettings, on_warm: Callable[[KVCacheManager], None] | None = None
) -> StepResult:
    """Warm up, then time ``settings.timed_steps`` steps of the stream through ``pool``'s
    manager; only the manager's calls are timed. ``on_warm`` gets the manager between the two
    (the memory figure reads it there)."""
    max_model_len = DOCUMENT_TOKENS + QUESTION_TOKENS + OUTPUT_TOKENS[1]
    manager = make_manager(pool, settings.num_blocks, max_model_len)
    stream = RequestStream(settings)
    running: dict[str, tuple[Request, int]] = {}
    times: list[float] = []
    ops = hits = queried = 0
    clock = time.process_time
    for step in range(settings.warmup_steps + settings.timed_steps):
        if step == settings.warmup_steps and on_warm is not None:
            on_warm(manager)
        elapsed = 0.0
        step_ops = step_hits = step_queried = 0
        finished = [request for request, output in running.values()
                    if request.num_output_tokens >= output]  # fmt: skip
        for request in finished:
            del running[request.request_id]
            step_ops += len(manager.get_block_ids(request.request_id)[0])
            started = clock()
            manager.free(request)
            elapsed += clock() - started
        # Decode: the token sampled in the step before is computed, a slot for it allocated.
        started = clock()
        for request, _ in running.values():
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError(f"{pool}: no room for a decode step; the pool is too small")
        elapsed += clock() - started
        for request, _ in running.values():
            computed = request.num_computed_tokens
            # A block allocated when the token starts one, cached when it fills one.
            step_ops += (computed % BLOCK_TOKENS == 0) + ((computed + 1) % BLOCK_TOKENS == 0)
        while len(running) < settings.batch:
            request, output = stream.next()
            started = clock()
            computed_blocks, num_computed, _ = manager.get_computed_blocks(request)
            blocks = manager.allocate_slots(
                request, request.num_tokens - num_computed,
                num_new_computed_tokens=num_computed, new_computed_blocks=computed_blocks,
            )  # fmt: skip
            elapsed += clock() - started
            if blocks is None:
                raise RuntimeError(f"{pool}: no room to admit a request; the pool is too small")
            full, hit = request.num_tokens // BLOCK_TOKENS, num_computed // BLOCK_TOKENS
            # Hit blocks looked up and touched; the rest allocated; the full ones cached.
            step_ops += 2 * hit + (-(-request.num_tokens // BLOCK_TOKENS) - hit) + full - hit
            step_hits += hit
            step_queried += full
            running[request.request_id] = (request, output)
            request.num_computed_tokens = request.num_tokens - 1  # its first step computes it
        # The model's part of the step: each running request computes a token and samples one.
        for request, _ in running.values():
            request.num_computed_tokens += 1
            request.append_output_token_ids(4 + request.num_tokens % 30_000)
        if step >= settings.warmup_steps:
            times.append(elapsed)
            ops += step_ops
            hits += step_hits
            queried += step_queried
    return StepResult(pool, times, ops, hits, queried)


def warmup_steps_for(num_blocks: int, batch: int) -> int:
    """Steps that would allocate the pool twice over if no prompt block hit: a block per 16
    decoded tokens of each running request, and about ``batch / 160`` admissions (the mean
    output length) of ~40 blocks. With the stream's hits the pool is full and evicting when
    the timed steps start (``tests/plugin/test_bench_step.py``)."""
    per_step = batch / BLOCK_TOKENS + batch / 160 * 40
    return int(2 * num_blocks / per_step)


def bench_steps(
    pools: tuple[int, ...] = (30_000, 100_000),
    batches: tuple[int, ...] = (64, 256),
    timed_steps: int = 400,
    repeats: int = 2,
) -> list[dict[str, Any]]:
    """Rows: blocks, batch, pool, mean and p99 microseconds per step, block ops per step, hit
    rate, and for the plugin's pools the microseconds added to native and their share of a
    ``STEP_BUDGET_S`` step. Best of ``repeats`` (by mean), the pools taking turns."""
    rows = []
    for num_blocks in pools:
        for batch in batches:
            settings = StepSettings(num_blocks, batch, warmup_steps_for(num_blocks, batch),
                                    timed_steps)  # fmt: skip
            best: dict[str, StepResult] = {}
            for _ in range(repeats):
                for pool in (NATIVE, *PLUGIN_POLICIES):
                    gc.collect()
                    result = replay(pool, settings)
                    if pool not in best or result.mean_us < best[pool].mean_us:
                        best[pool] = result
            native = best[NATIVE].mean_us
            for pool, result in best.items():
                added = None if pool == NATIVE else result.mean_us - native
                rows.append({
                    "blocks": num_blocks, "batch": batch, "pool": pool,
                    "warmup_steps": settings.warmup_steps, "timed_steps": timed_steps,
                    "us_per_step": result.mean_us, "p99_us": result.p99_us,
                    "block_ops_per_step": result.block_ops / timed_steps,
                    "hit_rate": result.hit_rate,
                    "added_us": added,
                    "added_share": None if added is None else added * 1e-6 / STEP_BUDGET_S,
                })  # fmt: skip
    return rows


def plugin_bytes(pool: PolicyBlockPool) -> int:
    """Bytes of every object the plugin's side of ``pool`` holds that vLLM's side does not:
    everything reachable from the policy and the adapter's maps (``_block_of``, ``_key_of``),
    less the blocks, the keys of vLLM's prefix-cache map and code (types, functions,
    modules). ``tests/plugin/test_bench_step.py`` holds it to tracemalloc's count."""
    shared = {id(pool), id(None), id(True), id(False)}
    shared.update(id(block) for block in pool.blocks)
    shared.update(id(key) for key in pool.cached_block_hash_to_block._cache)
    code = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.MethodType)  # fmt: skip
    pending: list[Any] = [pool.policy, pool._block_of, pool._key_of]
    seen: set[int] = set()
    total = 0
    while pending:
        item = pending.pop()
        if id(item) in shared or id(item) in seen or isinstance(item, code):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        pending.extend(gc.get_referents(item))
    return total


def bench_memory(
    pools: tuple[int, ...] = (30_000, 100_000), batch: int = 64
) -> list[dict[str, Any]]:
    """Rows: blocks, policy, the plugin's bytes per cached block after the warm-up
    (``plugin_bytes`` over the pool's blocks), ghost keys then, and that as a share of one
    block's KV memory for each of ``MODEL_BLOCK_BYTES``."""
    rows = []
    for num_blocks in pools:
        settings = StepSettings(num_blocks, batch, warmup_steps_for(num_blocks, batch), 1)
        for policy in PLUGIN_POLICIES:
            found: dict[str, int] = {}

            def measure(manager: KVCacheManager, found: dict[str, int] = found) -> None:
                pool = manager.block_pool
                assert isinstance(pool, PolicyBlockPool)
                found["bytes"] = plugin_bytes(pool)
                sizes = pool.policy.list_sizes()
                found["ghosts"] = sum(sizes.get(name, 0) for name in pool.policy.ghost_lists)

            replay(policy, settings, on_warm=measure)
            per_block = found["bytes"] / num_blocks
            rows.append({
                "blocks": num_blocks, "policy": policy, "bytes_per_block": per_block,
                "ghosts": found["ghosts"],
                "kv_share": {model: per_block / size for model, size in MODEL_BLOCK_BYTES.items()},
            })  # fmt: skip
    return rows


def print_steps(rows: list[dict[str, Any]], repeats: int) -> None:
    first = rows[0]
    print(
        f"vLLM KVCacheManager per scheduler step: document QA at scale ({DOCUMENT_TOKENS}-token "
        f"documents, Zipf {ZIPF_EXPONENT} over 4x the documents the pool holds, "
        f"{QUESTION_TOKENS}-token questions, {OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} output tokens), "
        f"{BLOCK_TOKENS}-token blocks; CPU time of the manager's calls, mean of "
        f"{first['timed_steps']} steps after a warm-up that fills the pool; best of "
        f"{repeats}, one core"
    )
    print(
        f"{'blocks':>8} {'batch':>5} {'pool':<12} {'warm-up':>7} {'ops/step':>8} "
        f"{'hit rate':>8} {'us/step':>8} {'p99 us':>8} {'added us':>9} {'of 10 ms':>9}"
    )
    for row in rows:
        added = row["added_us"]
        extra = "" if added is None else f"{added:>+9.1f} {100 * row['added_share']:>8.2f}%"
        print(
            f"{row['blocks']:>8,} {row['batch']:>5} {row['pool']:<12} {row['warmup_steps']:>7,} "
            f"{row['block_ops_per_step']:>8.0f} {row['hit_rate']:>8.3f} "
            f"{row['us_per_step']:>8.1f} {row['p99_us']:>8.1f} {extra}".rstrip()
        )


def print_memory(rows: list[dict[str, Any]], batch: int) -> None:
    print(
        f"plugin memory per cached block, after the same warm-up (batch {batch}): bytes the "
        f"plugin holds that vLLM does not, over the pool's blocks; share of one "
        f"{BLOCK_TOKENS}-token block's KV memory (bf16)"
    )
    models = list(MODEL_BLOCK_BYTES)
    header = "".join(f" {model.split(' ')[0] + f' ({MODEL_BLOCK_BYTES[model] // 1024:,} KiB)':>26}"
                     for model in models)  # fmt: skip
    print(f"{'blocks':>8} {'policy':<7} {'bytes/block':>11} {'ghost keys':>10}{header}")
    for row in rows:
        shares = "".join(f" {100 * row['kv_share'][model]:>25.4f}%" for model in models)
        print(
            f"{row['blocks']:>8,} {row['policy']:<7} {row['bytes_per_block']:>11.0f} "
            f"{row['ghosts']:>10,}{shares}"
        )


def main(repeats: int) -> None:
    """The per-step and memory sections of ``make bench``."""
    print_steps(bench_steps(repeats=repeats), repeats)
    print()
    print_memory(bench_memory(), 64)
