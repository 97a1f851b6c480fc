"""A policy-driven ``BlockPool`` for vLLM 0.32 and 0.33, and standalone pools built the same way.

``PolicyBlockPool`` subclasses vLLM's ``BlockPool`` and replaces the unnamed queue-position
eviction order with an ``EvictionPolicy`` keyed by block hash (``BlockHashWithGroupId``, which
carries the KV cache group: one policy serves every group of vLLM's shared pool). Keying by
hash, not by block id, is what lets ARC's ghost lists recognise a prefix that was evicted and
comes back in another block, and what makes the plugin's decisions equal to the simulator's
(``arc_simulator.pool.BlockPool``) on the same trace. Everything but the choice of victim is
vLLM's own: with ``lru`` the pool hands out the blocks vLLM's free queue would, in its order,
with its KV events (``docs/plugin.md``, "Equal to vLLM").

The vLLM internals this module relies on (private attributes of ``BlockPool``,
``KVCacheBlock`` and ``BlockHashToBlockMap``, and the ``BlockPool`` methods it overrides) are
listed with what each is used for in ``patches.VLLM_INTERNALS``; ``patches`` puts the pool into
vLLM's KV cache manager. Both modules are imported only after ``version.check_vllm_version``
accepted the installed vLLM.

``build_block_pool``, ``request_builder`` and ``get_new_blocks_for`` drive a pool outside a KV
cache manager the way the manager and the ``patches`` wrappers do, so a benchmark
(``arc_dev.bench.plugin``) can compare vLLM's own pool with a policy pool without importing
vLLM internals itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    resolve_block_hashes,
)
from vllm.v1.request import Request

from arc_evictor.policies import EvictionPolicy, make_policy
from arc_evictor.vllm_plugin.version import UnsupportedVllmError, vllm_series

# BlockPool, KVCacheBlock and Request are vLLM's, exported for the type hints of callers that
# drive a pool through the helpers below.
__all__ = [
    "Allocation",
    "BlockPool",
    "Entry",
    "KVCacheBlock",
    "Key",
    "PolicyBlockPool",
    "Request",
    "build_block_pool",
    "get_new_blocks_for",
    "hash_of",
    "request_builder",
]

Key = BlockHashWithGroupId
# What the policy orders: the key for a key's first copy, (key, serial) for a further copy.
Entry = Key | tuple[Key, int]
# vLLM 0.32's touch and free_blocks count the null block's references; 0.33's skip it
# (its ref_cnt "is not maintained"). The pool does what the installed vLLM does.
NULL_BLOCK_REFCOUNTED = vllm_series() == "0.32"


class Allocation:
    """What the allocation in progress is for: set by the manager wrappers, read by the pool.

    ``start`` is the index, in the request's block table, of the first block the next
    ``get_new_blocks`` call hands out, or None when that call's blocks get no key (another
    group, a copy-on-write block, a request with a partial prefix-cache hit).
    """

    __slots__ = ("block_size", "group_id", "request", "start")

    def __init__(
        self, request: Request, start: int | None = None, block_size: int = 0, group_id: int = 0
    ) -> None:
        self.request = request
        self.start = start
        self.block_size = block_size
        self.group_id = group_id

    def keys(self, hash_block_size: int, count: int) -> list[Key | None]:
        """The prefix-cache key each of the next ``count`` new blocks will get (None: no key).

        A key is built as vLLM's ``make_block_hash_with_group_id`` builds it (the block hash,
        then the group id in 4 big-endian bytes), inline because this runs for every allocated
        block; a test holds the two equal.
        """
        start = self.start
        if start is None:
            return [None] * count
        hashes = resolve_block_hashes(self.request.block_hashes, hash_block_size, self.block_size)
        group = self.group_id.to_bytes(4, "big")
        keys: list[Key | None] = [h + group for h in hashes[start : start + count]]
        if len(keys) < count:
            keys += [None] * (count - len(keys))
        return keys


def hash_of(entry: Entry) -> Key:
    """The prefix-cache key (``BlockHashWithGroupId``) a policy entry stands for."""
    return entry if isinstance(entry, bytes) else entry[0]


class PolicyBlockPool(BlockPool):
    """vLLM's ``BlockPool`` with every eviction decision made by an ``EvictionPolicy``.

    The policy orders *entries*, one per block that holds (or is pending for) a prefix-cache
    key: the first copy of a key is the key itself, a further copy is ``(key, serial)``. vLLM
    keeps copies as they are (``BlockHashToBlockMap``, NOTE #1: block tables are append-only),
    so each copy is released, hit and evicted on its own, as in vLLM's free queue.

    Where blocks live (vLLM's own free queue keeps only blocks without a hash):

    - ``free_block_queue``: free blocks without a hash, in vLLM's order (reused first, LIFO);
    - ``_block_of[entry]``: the block of every resident policy entry; ``_key_of[block_id]``:
      the entry a block holds or is pending for (None: no key);
    - a free block with a hash is an unpinned resident entry: the policy names it when it is
      to be evicted.

    Invariants (``verify`` recounts them):

    - apart from the null block, a block has ``ref_cnt == 0`` exactly when it is in the free
      queue (no hash) or its entry is resident and unpinned (it has a hash);
    - ``get_num_free_blocks() == free_block_queue.num_free_blocks + _num_evictable`` is the
      number of non-null blocks with ``ref_cnt == 0`` (the scheduler admits requests by it);
    - the policy's resident keys are exactly the keys of ``_block_of``; ``_key_of`` maps each
      of their blocks back to its entry and no other block to anything; every (key, block) of
      vLLM's prefix-cache map is a resident entry's block with that key, or with that key
      among the block's partial-block keys (``cached_block_hashes_by_block``): one policy
      entry per block, for its primary hash.

    ``BlockPool`` calls mapped onto the policy's call protocol (``arc_evictor.policies.base``;
    ``docs/plugin.md``), one batched policy call per pool call on the hot paths:

    - ``touch`` (ref 0 -> 1 of a cached block: a committed hit): ``policy.touch``, the
      request's cached prefix tail first (vLLM passes it head first), each block ``pin`` then
      ``find`` (a policy never re-orders a block ``pin`` takes out);
    - ``get_new_blocks``: ``policy.allocate``, each new block tail first: ``find`` ->
      (``to_evict`` + ``evict`` once the blocks without a hash are used) -> ``insert``, where
      the incoming key is known from the request being allocated (its ``Allocation``). The
      blocks are taken in vLLM's free-queue order (the blocks without a hash, then the
      victims') and handed out head first, as ``popleft_n`` does, so with ``lru`` the block
      ids, their order and the KV events are vLLM's own;
    - ``cache_full_blocks``: a block gets its hash; its entry was inserted at allocation, or
      is inserted now when the allocation had no key for it;
    - ``cache_partial_block`` (a full-attention group whose blocks are larger than the hash
      unit registers the prompt's last hash boundary inside a block): a block that holds a
      hash keeps its entry, the partial key is vLLM's lookup metadata and leaves vLLM's map
      with the block; a held block without a hash takes the partial key as its entry's;
    - ``free_blocks``: ref 1 -> 0: ``policy.release``, ``unpin`` in vLLM's order (tail
      first);
    - ``evict_blocks`` / ``reset_prefix_cache``: ``remove`` / ``clear``.

    Cost: per block the hot paths (``touch``, ``get_new_blocks``, ``free_blocks``) do what
    vLLM's free queue does plus one list read of ``_key_of``, and each makes one policy call
    for all its blocks (``arc_dev.bench.plugin`` measures both).
    """

    def __init__(self, *args: Any, policy_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Cacheable capacity: every block but the null block, so every copy fits.
        self.policy: EvictionPolicy = make_policy(policy_name, self.num_gpu_blocks - 1)
        # Owned here; the keys of ``_block_of`` are exactly the policy's resident keys, so the
        # pool tests residency with a dict lookup instead of a policy call.
        self._block_of: dict[Entry, KVCacheBlock] = {}
        # Owned here: block id -> the entry the block holds or is pending for (None: no key).
        self._key_of: list[Entry | None] = [None] * self.num_gpu_blocks
        self._copies = itertools.count(1)  # serials of further copies' entries
        self._num_evictable = 0  # unpinned resident entries = free blocks that hold a hash
        self.allocation: Allocation | None = None  # owned by the manager wrappers
        # Plugin counters (metrics read them): committed hits, queried blocks, switches.
        self.block_hits = 0
        self.block_queries = 0
        self.policy_switches = 0

    def _entry_for(self, key: Key) -> Entry:
        """The entry a new block holding ``key`` gets: the key, or a copy's if it is taken."""
        return self._copy_entry(key) if key in self._block_of else key

    def _copy_entry(self, key: Key) -> Entry:
        """A further copy's entry for ``key``, whose own entry is resident."""
        return (key, next(self._copies))

    # ----------------------------------------------------------------- free-block accounting
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks + self._num_evictable

    # ----------------------------------------------------------------------------- hits
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        key_of, metrics = self._key_of, self.metrics_collector
        entries: list[Entry] = []
        newly_pinned: list[bool] = []
        # vLLM passes the prefix head first; the protocol (and the simulator) take it tail first.
        for block in reversed(blocks):
            entry = key_of[block.block_id]
            if entry is None:
                if block.is_null:
                    if NULL_BLOCK_REFCOUNTED:
                        block.ref_cnt += 1
                    continue
                if block.ref_cnt == 0:
                    self.free_block_queue.remove(block)
            else:
                # The protocol pins a cached entry (ref 0 -> 1) before its find.
                entries.append(entry)
                newly_pinned.append(block.ref_cnt == 0)
            block.ref_cnt += 1
            if metrics:
                metrics.on_block_accessed(block)
        if entries:
            self.policy.touch(entries, newly_pinned)
            self._num_evictable -= newly_pinned.count(True)
            if self.allocation is not None:
                self.block_hits += len(entries)

    # ------------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        allocation = self.allocation
        if allocation is None or not self.enable_caching:
            keys: list[Key | None] = [None] * num_blocks
        else:
            keys = allocation.keys(self.hash_block_size, num_blocks)
        if allocation is not None:
            # Later calls in the same allocation (another group, a CoW block) get no keys.
            allocation.start = None
        block_of, key_of, metrics = self._block_of, self._key_of, self.metrics_collector
        queue = self.free_block_queue
        # One policy call for the whole request, tail first as the protocol goes; the keys
        # of one call are distinct (chained hashes of one group), so only older entries can
        # be taken, and those get a copy's entry.
        free = min(queue.num_free_blocks, num_blocks)
        entries, victims = self.policy.allocate(keys, free, self._copy_entry)
        # The blocks in vLLM's free-queue order: blocks without a hash first, then the
        # victims' (never an entry of this call: those are inserted pinned).
        taken = queue.popleft_n(free) if free else []
        if self.enable_caching and metrics:
            # vLLM reports every block it reuses with caching on as evicted from its KV
            # cache metrics (a no-op for blocks it does not sample); the plugin keeps that.
            for block in taken:
                metrics.on_block_evicted(block)
        for victim in victims:
            block = block_of.pop(victim)
            key_of[block.block_id] = None
            # vLLM's own eviction path: BlockRemoved events and KV cache metrics fire.
            self._maybe_evict_cached_block(block)
            taken.append(block)
        evicted = len(victims)
        self._num_evictable -= evicted
        if self._reuse_watchers:
            self._notify_reuse(taken)
        # Handed out in the order taken, as vLLM's popleft_n does: block i of the request is
        # the i-th block taken from the free queue.
        for block, entry in zip(taken, entries, strict=True):
            if entry is not None:
                block_of[entry] = block
                key_of[block.block_id] = entry
            assert block.ref_cnt == 0, f"block {block.block_id} handed out with refs"
            block.ref_cnt = 1
            if metrics:
                metrics.on_block_allocated(block)
        return taken

    # --------------------------------------------------------------------------- caching
    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        super().cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        if not self.enable_caching:
            return
        key_of = self._key_of
        for block in blocks[num_cached_blocks:num_full_blocks]:
            key = block._block_hash  # the slot behind the block_hash property
            if key is None:
                continue  # the null block, or masked out
            known = key_of[block.block_id]
            if known is None or hash_of(known) != key:
                # A key decided after allocation (no Allocation, or not the predicted one).
                self._follow_primary_hash(block, known)

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Key | None:
        # vLLM registers the partial key as lookup metadata owned by the block: a further key
        # of a block that holds a hash (cached_block_hashes_by_block), else its primary hash.
        # The policy keeps one entry per block, for its primary hash: the further keys leave
        # vLLM's map with the block when it is evicted, as in vLLM.
        key = super().cache_partial_block(
            request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes
        )
        if key is not None:
            known = self._key_of[block.block_id]
            if known is None or hash_of(known) != block._block_hash:
                self._follow_primary_hash(block, known)
        return key

    def _follow_primary_hash(self, block: KVCacheBlock, known: Entry | None) -> None:
        """Held ``block`` got a primary hash other than ``known``'s: its entry follows it."""
        assert block.ref_cnt > 0, f"free block {block.block_id} got a hash outside the policy"
        if known is not None:
            self._drop_entry(block, known)
        entry = self._entry_for(block._block_hash)
        self.policy.find(entry)
        if len(self.policy) >= self.policy.capacity:
            raise RuntimeError(f"policy full while caching block {block.block_id}")
        self.policy.insert(entry)
        self._block_of[entry] = block
        self._key_of[block.block_id] = entry

    def _drop_entry(self, block: KVCacheBlock, entry: Entry) -> None:
        """Held ``block`` no longer stands for ``entry``: the entry leaves the policy."""
        del self._block_of[entry]
        self._key_of[block.block_id] = None
        self.policy.unpin(entry)
        self.policy.remove(entry)

    # --------------------------------------------------------------------------- release
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        evict_first: list[KVCacheBlock] = []
        other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
        key_of = self._key_of
        released: list[Entry] = []
        for block in ordered_blocks:
            if block.is_null:
                if NULL_BLOCK_REFCOUNTED:
                    block.ref_cnt -= 1
                continue
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            entry = key_of[block.block_id]
            if entry is None:
                evict_first.append(block)
            elif block._block_hash is None:  # the slot behind block_hash
                # Allocated for a key but never cached (finished early, or masked out).
                self._drop_entry(block, entry)
                evict_first.append(block)
            else:
                # A cached block: it stays cached, a candidate for eviction.
                released.append(entry)
        if released:
            self.policy.release(released)
            self._num_evictable += len(released)
        # LIFO reuse of blocks without a hash, as vLLM does (better locality).
        self.free_block_queue.prepend_n(evict_first)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    # ---------------------------------------------------------------- invalidation
    def evict_blocks(self, block_ids: set[int]) -> None:
        for block_id in block_ids:
            assert block_id < len(self.blocks), (
                f"Invalid block_id {block_id} >= {len(self.blocks)}: the KV connector reported "
                "a block the scheduler never allocated"
            )
            block = self.blocks[block_id]
            entry = self._key_of[block_id]
            if entry is not None:
                del self._block_of[entry]
                self._key_of[block_id] = None
                if block.ref_cnt == 0:
                    self._num_evictable -= 1
                    # vLLM leaves the block where it is in its queue; without a hash it joins
                    # the end of the blocks reused first (docs/plugin.md, "Equal to vLLM").
                    self.free_block_queue.append(block)
                else:
                    self.policy.unpin(entry)
                self.policy.remove(entry)
            self._maybe_evict_cached_block(block)

    def reset_prefix_cache(self) -> bool:
        order = [self._block_of[entry] for entry in self.policy.resident_keys()]
        if not super().reset_prefix_cache():
            return False
        # Every block is free (vLLM checked): the cached ones join the free queue in the
        # policy's eviction order (vLLM's queue order with lru), and the policy forgets
        # everything, history included.
        self.free_block_queue.append_n(order)
        self._block_of.clear()
        self._key_of = [None] * self.num_gpu_blocks
        self._num_evictable = 0
        self.policy.clear()
        return True

    # ------------------------------------------------------------------- live switch
    def switch_policy(self, name: str) -> EvictionPolicy:
        """Replace the policy by ``name``, carrying every resident entry in recency order.

        Called between scheduler steps. Raises PolicyError (and changes nothing) for an
        unknown name. Ghost history does not carry over: the new policy starts it afresh.
        """
        new = make_policy(name, self.policy.capacity)
        for entry in self.policy.resident_keys():
            new.find(entry)
            new.insert(entry)
            if self._block_of[entry].ref_cnt == 0:
                new.unpin(entry)
        self.policy = new
        self.policy_switches += 1
        return new

    def prefix_cache_keys(self) -> set[Key]:
        """The keys vLLM's own prefix-cache map holds a block for: what a request can hit.

        Read from vLLM's ``cached_block_hash_to_block``, not from this class's bookkeeping, so
        a live switch can be checked against the pool itself.
        """
        return {key for key, blocks in self.cached_block_hash_to_block._cache.items() if blocks}

    def resident_hashes(self, policy: EvictionPolicy | None = None) -> set[Key]:
        """The prefix-cache keys ``policy`` (default: the pool's) holds an entry for."""
        return {hash_of(entry) for entry in (policy or self.policy).resident_keys()}

    # ------------------------------------------------------------- unsupported paths
    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[..., None]) -> None:
        raise UnsupportedVllmError("arc_evictor: BlockPool.unpin_blocks (HiSparse) is unsupported")

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        raise UnsupportedVllmError("arc_evictor: moving block hashes (CoW) is unsupported")

    # ------------------------------------------------------------------------ checks
    def verify(self) -> None:
        """Recount every invariant in the class docstring; AssertionError names the drift."""
        policy = self.policy
        policy.verify()
        assert set(self._block_of) == set(policy.resident_keys()), (
            "policy resident keys and the pool's entries differ"
        )
        assert len(self._block_of) == len(policy), "policy length differs from the entries"
        assert len(self._key_of) == len(self.blocks), "block -> entry table has the wrong size"
        key_of = {i: entry for i, entry in enumerate(self._key_of) if entry is not None}
        assert len(key_of) == len(self._block_of), "a block maps to an entry it does not hold"
        in_queue = {b.block_id for b in self.free_block_queue.get_all_free_blocks()}
        evictable = 0
        for entry, block in self._block_of.items():
            assert key_of.get(block.block_id) == entry, (
                f"block {block.block_id} not mapped back to its entry"
            )
            assert not block.is_null, "the null block holds an entry"
            assert block.block_id not in in_queue, f"cached block {block.block_id} in queue"
            if block._block_hash is not None:
                assert block._block_hash == hash_of(entry), f"block {block.block_id} hash != key"
            if block.ref_cnt == 0:
                assert block._block_hash is not None, f"free block {block.block_id} not cached"
                evictable += 1
        assert evictable == self._num_evictable, (
            f"evictable count {self._num_evictable} != recount {evictable}"
        )
        further = self.cached_block_hashes_by_block
        for key, blocks in self.cached_block_hash_to_block._cache.items():
            for block in [blocks] if isinstance(blocks, KVCacheBlock) else blocks.values():
                entry = key_of.get(block.block_id)
                assert entry is not None, f"vLLM caches block {block.block_id} without an entry"
                assert hash_of(entry) == key or key in further.get(block.block_id, ()), (
                    f"vLLM caches block {block.block_id} under a key that is neither its "
                    "entry's nor one of its partial keys"
                )
        free_by_ref = 0
        for block in self.blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                free_by_ref += 1
                assert block.block_id in in_queue or block.block_id in key_of, (
                    f"free block {block.block_id} is neither queued nor cached"
                )
            else:
                assert block.block_id not in in_queue, f"held block {block.block_id} in queue"
        for block_id in in_queue:
            assert self.blocks[block_id].block_hash is None, f"queued block {block_id} has hash"
        assert free_by_ref == self.get_num_free_blocks(), (
            f"free count {self.get_num_free_blocks()} != blocks with ref_cnt 0 ({free_by_ref})"
        )


# ------------------------------------------------------------------ pools outside vLLM's manager
def build_block_pool(num_blocks: int, block_size: int, policy_name: str | None) -> BlockPool:
    """A prefix-caching pool of ``num_blocks`` blocks: vLLM's own (``policy_name`` None, its
    LRU free queue) or a ``PolicyBlockPool`` evicting by ``policy_name``."""
    if policy_name is None:
        return BlockPool(num_blocks, enable_caching=True, hash_block_size=block_size)
    return PolicyBlockPool(
        num_blocks, enable_caching=True, hash_block_size=block_size, policy_name=policy_name
    )


def request_builder(block_size: int) -> Callable[[str, list[int]], Request]:
    """A function ``(request_id, prompt_token_ids) -> Request`` for one-token generations,
    hashed by vLLM's own request block hasher (sha256, ``block_size`` tokens a block)."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)

    def build(request_id: str, prompt_token_ids: list[int]) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
        )

    return build


def get_new_blocks_for(
    pool: BlockPool, request: Request, start: int, block_size: int, num_blocks: int
) -> list[KVCacheBlock]:
    """``pool.get_new_blocks(num_blocks)`` for the blocks of ``request`` from index ``start`` of
    its block table, as vLLM's KV cache manager asks for them with the ``patches`` wrappers
    installed: a ``PolicyBlockPool`` learns the keys the blocks will hold (group 0)."""
    if not isinstance(pool, PolicyBlockPool):
        return pool.get_new_blocks(num_blocks)
    pool.allocation = Allocation(request, start, block_size)
    try:
        return pool.get_new_blocks(num_blocks)
    finally:
        pool.allocation = None
