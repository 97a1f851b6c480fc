"""A policy-driven ``BlockPool`` for vLLM 0.32, and standalone pools built the same way.

``PolicyBlockPool`` subclasses vLLM's ``BlockPool`` and replaces the unnamed queue-position
eviction order with an ``EvictionPolicy`` keyed by block hash (``BlockHashWithGroupId``).
Keying by hash, not by block id, is what lets ARC's ghost lists recognise a prefix that was
evicted and comes back in another block, and what makes the plugin's decisions equal to the
simulator's (``arc_simulator.pool.BlockPool``) on the same trace.

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
from arc_evictor.vllm_plugin.version import UnsupportedVllmError

# BlockPool, KVCacheBlock and Request are vLLM's, exported for the type hints of callers that
# drive a pool through the helpers below.
__all__ = [
    "Allocation",
    "BlockPool",
    "KVCacheBlock",
    "Key",
    "PolicyBlockPool",
    "Request",
    "build_block_pool",
    "get_new_blocks_for",
    "request_builder",
]

Key = BlockHashWithGroupId


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


class PolicyBlockPool(BlockPool):
    """vLLM's ``BlockPool`` with every eviction decision made by an ``EvictionPolicy``.

    Where blocks live (vLLM's own free queue keeps only blocks without a hash):

    - ``free_block_queue``: free blocks without a hash, reused first, LIFO as vLLM does;
    - ``_primary[key]``: the block holding ``key`` that vLLM's ``get_one_block`` returns, for
      every resident policy key; ``_spare[key]``: the further copies, oldest first (rare, so
      the common path keeps no list per key); ``_key_of[block_id]``: the key a block holds or
      is pending for;
    - a free block with a hash is the only copy of an unpinned resident key: the policy names
      it when it is to be evicted. A second copy of a key (vLLM recomputed a block another
      request holds) is dropped from the prefix cache as soon as its last user releases it.

    Invariants (``verify`` recounts them):

    - apart from the null block, a block has ``ref_cnt == 0`` exactly when it is in the free
      queue (no hash) or it is the single copy of an unpinned resident key;
    - ``get_num_free_blocks() == free_block_queue.num_free_blocks + _num_evictable`` is the
      number of non-null blocks with ``ref_cnt == 0`` (the scheduler admits requests by it);
    - the policy's resident keys are exactly the keys of ``_primary``; a key is pinned in the
      policy exactly when its primary copy has ``ref_cnt > 0``; a key with spare copies has
      every copy held; ``_key_of`` maps back exactly the primary, spare and pending blocks.

    ``BlockPool`` calls mapped onto the policy's call protocol (``arc_evictor.policies.base``;
    ``docs/plugin.md``):

    - ``touch`` (ref 0 -> 1 of a cached block: a committed hit): the request's cached prefix,
      tail first (vLLM passes it head first), each block ``pin`` then ``find`` (a policy never
      re-orders a block ``pin`` takes out);
    - ``get_new_blocks``: knows the incoming keys of the request being allocated (its
      ``Allocation``) and runs the order of the simulator's ``arc_simulator.pool.BlockPool.take``:
      first every incoming key already resident is taken (its free copy is handed back to the
      request, so no duplicate is made), then each miss, tail first, is ``find`` ->
      (``to_evict`` + ``evict`` while no block without a hash is free) -> ``insert``;
    - ``cache_full_blocks``: a block gets its hash; the key was inserted at allocation, or is
      inserted now when the allocation had no key for it;
    - ``free_blocks``: ref 1 -> 0: ``unpin`` in vLLM's order (tail first);
    - ``evict_blocks`` / ``reset_prefix_cache``: ``remove`` / ``clear``.

    Cost: per block the hot paths (``touch``, ``get_new_blocks``, ``free_blocks``) do what
    vLLM's free queue does plus one list read of ``_key_of`` and the policy calls of the
    protocol (``arc_dev.bench.plugin`` measures both); the rare cases (second copies, keys
    that were never cached) leave the loop for helper methods.
    """

    def __init__(self, *args: Any, policy_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Cacheable capacity: every block but the null block.
        self.policy: EvictionPolicy = make_policy(policy_name, self.num_gpu_blocks - 1)
        # Owned here; the keys of ``_primary`` are exactly the policy's resident keys, so the
        # pool tests residency with a dict lookup instead of a policy call.
        self._primary: dict[Key, KVCacheBlock] = {}  # the copy vLLM's get_one_block returns
        self._spare: dict[Key, list[KVCacheBlock]] = {}  # further copies, all held; rare
        # Owned here: block id -> the key the block holds or is pending for (None: no key).
        self._key_of: list[Key | None] = [None] * self.num_gpu_blocks
        self._num_evictable = 0  # unpinned resident keys = free blocks that hold a hash
        self.allocation: Allocation | None = None  # owned by the manager wrappers
        # Plugin counters (metrics read them): committed hits, queried blocks, switches.
        self.block_hits = 0
        self.block_queries = 0
        self.policy_switches = 0

    # ----------------------------------------------------------------- free-block accounting
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks + self._num_evictable

    # ----------------------------------------------------------------------------- hits
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        policy, key_of, metrics = self.policy, self._key_of, self.metrics_collector
        pin, find = policy.pin, policy.find
        hits = pinned = 0
        # vLLM passes the prefix head first; the protocol (and the simulator) take it tail first.
        for block in reversed(blocks):
            key = key_of[block.block_id]
            if key is None:
                if block.is_null:
                    block.ref_cnt += 1
                    continue
                if block.ref_cnt == 0:
                    self.free_block_queue.remove(block)
            else:
                if block.ref_cnt == 0:
                    # Only a single, unpinned copy can be free (class invariant). The
                    # protocol pins a cached key before its find.
                    pin(key)
                    pinned += 1
                find(key)
                hits += 1
            block.ref_cnt += 1
            if metrics:
                metrics.on_block_accessed(block)
        self._num_evictable -= pinned
        if self.allocation is not None:
            self.block_hits += hits

    # ------------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        allocation = self.allocation
        if allocation is None:
            keys: list[Key | None] = [None] * num_blocks
        else:
            keys = (
                allocation.keys(self.hash_block_size, num_blocks)
                if self.enable_caching
                else [None] * num_blocks
            )
            # Later calls in the same allocation (another group, a CoW block) get no keys.
            allocation.start = None
        policy, primaries, key_of = self.policy, self._primary, self._key_of
        find, metrics = policy.find, self.metrics_collector
        out: list[KVCacheBlock | None] = [None] * num_blocks
        # Pass 1, tail first: incoming keys already resident are taken before any eviction.
        misses: list[int] = []
        for i in range(num_blocks - 1, -1, -1):
            key = keys[i]
            primary = primaries.get(key)  # type: ignore[arg-type]  (None is never a key)
            if primary is None:
                misses.append(i)
            elif primary.ref_cnt == 0:
                # The free copy holds exactly the KV the request would recompute: hand it
                # back (out of the prefix cache until cache_full_blocks re-hashes it).
                policy.pin(key)
                find(key)
                self._num_evictable -= 1
                self._maybe_evict_cached_block(primary)
                primary.ref_cnt = 1
                if metrics:
                    metrics.on_block_allocated(primary)
                out[i] = primary
            else:
                find(key)
                keys[i] = None  # held elsewhere: this block becomes a second copy if cached
                misses.append(i)
        # Pass 2, tail first: the misses, each making room before it is inserted.
        queue = self.free_block_queue
        # vLLM reports every block it reuses with caching on as evicted from its KV cache
        # metrics (a no-op for blocks it does not sample); the plugin keeps that.
        reused = metrics if self.enable_caching else None
        evicted = 0
        for i in misses:
            key = keys[i]
            if key is not None:
                if key in primaries:
                    key = None  # a key this pass already inserted: a second copy
                else:
                    find(key)  # a ghost hit adapts ARC's target before the victim is chosen
            if queue.num_free_blocks:
                block = queue.popleft()
                if reused:
                    reused.on_block_evicted(block)
            else:
                # No block without a hash is free: evict the policy's victim. An unpinned key
                # has a single copy (class invariant), so there is no spare to promote.
                victim = policy.to_evict()
                if victim is None:
                    self._num_evictable -= evicted
                    raise RuntimeError(
                        f"policy {policy.describe()} named no victim with "
                        f"{self._num_evictable} evictable blocks counted"
                    )
                policy.evict(victim)
                block = primaries.pop(victim)
                key_of[block.block_id] = None
                evicted += 1
                # vLLM's own eviction path: BlockRemoved events and KV cache metrics fire.
                self._maybe_evict_cached_block(block)
            if key is not None:
                policy.insert(key)
                primaries[key] = block
                key_of[block.block_id] = key
            assert block.ref_cnt == 0, f"block {block.block_id} handed out with refs"
            block.ref_cnt = 1
            if metrics:
                metrics.on_block_allocated(block)
            out[i] = block
        self._num_evictable -= evicted
        blocks: list[KVCacheBlock] = out  # type: ignore[assignment]
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        return blocks

    def _drop_copy(self, block: KVCacheBlock, key: Key) -> bool:
        """Forget that ``block`` holds ``key`` (its hash is untouched); True if it was the last.

        When the primary goes and spares remain, the oldest spare becomes the primary, as in
        vLLM's hash map.
        """
        self._key_of[block.block_id] = None
        if self._primary[key] is not block:
            spares = self._spare[key]
            spares.remove(block)
            if not spares:
                del self._spare[key]
            return False
        spares = self._spare.pop(key, None)
        if spares is None:
            del self._primary[key]
            return True
        self._primary[key] = spares.pop(0)
        if spares:
            self._spare[key] = spares
        return False

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
            if known == key:
                continue  # inserted (or re-taken) at allocation
            if known is not None:
                self._forget_pending(block, known)
            self._adopt(block, key)

    def _adopt(self, block: KVCacheBlock, key: Key) -> None:
        """``block`` (held) just got hash ``key`` without an allocation-time decision."""
        policy = self.policy
        primary = self._primary.get(key)
        self._key_of[block.block_id] = key
        if primary is None:
            policy.find(key)
            if len(policy) >= policy.capacity:
                raise RuntimeError(f"policy full while caching block {block.block_id}")
            policy.insert(key)
            self._primary[key] = block
            return
        if primary.ref_cnt == 0:
            # The old copy is free and now redundant: the held block becomes the primary.
            policy.pin(key)
            policy.find(key)
            self._num_evictable -= 1
            self._primary[key] = block
            self._key_of[primary.block_id] = None
            self._drop_hashes(primary)
            self.free_block_queue.append(primary)
        else:
            self._spare.setdefault(key, []).append(block)

    def _drop_hashes(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of vLLM's prefix-cache map (events fire); keys untouched."""
        self._maybe_evict_cached_block(block)

    def _forget_pending(self, block: KVCacheBlock, key: Key) -> None:
        """``block`` will not hold ``key`` after all: drop it from the key's copies."""
        if self._drop_copy(block, key):
            # The key was inserted for this (held) block and never cached: it leaves the policy.
            self.policy.unpin(key)
            self.policy.remove(key)

    # --------------------------------------------------------------------------- release
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        evict_first: list[KVCacheBlock] = []
        other_pools: dict[BlockPool, list[KVCacheBlock]] = {}
        key_of, spare, unpin = self._key_of, self._spare, self.policy.unpin
        released = 0
        for block in ordered_blocks:
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt or block.is_null:
                continue
            key = key_of[block.block_id]
            if key is None:
                evict_first.append(block)
            elif key in spare or block._block_hash is None:  # the slot behind block_hash
                self._release_uncached(block, key)
                evict_first.append(block)
            else:
                # The single copy of a cached key: it stays cached, a candidate for eviction.
                unpin(key)
                released += 1
        self._num_evictable += released
        # LIFO reuse of blocks without a hash, as vLLM does (better locality).
        self.free_block_queue.prepend_n(evict_first)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    def _release_uncached(self, block: KVCacheBlock, key: Key) -> None:
        """Last user released ``block``, a redundant copy of ``key`` or never cached under it.

        The block leaves the prefix cache (it joins the free queue without a hash); the key
        leaves the policy when no copy of it is left.
        """
        last = self._drop_copy(block, key)
        if block.block_hash is not None:
            self._drop_hashes(block)
        if last:
            self.policy.unpin(key)
            self.policy.remove(key)

    # ---------------------------------------------------------------- invalidation
    def evict_blocks(self, block_ids: set[int]) -> None:
        for block_id in block_ids:
            assert block_id < len(self.blocks), (
                f"Invalid block_id {block_id} >= {len(self.blocks)}: the KV connector reported "
                "a block the scheduler never allocated"
            )
            block = self.blocks[block_id]
            key = self._key_of[block_id]
            if key is not None:
                if self._drop_copy(block, key):
                    if block.ref_cnt == 0:
                        self._num_evictable -= 1
                    else:
                        self.policy.unpin(key)
                    self.policy.remove(key)
                elif block.ref_cnt == 0:
                    raise RuntimeError(f"free block {block_id} was one of several copies")
                if block.ref_cnt == 0:
                    self.free_block_queue.append(block)
            self._maybe_evict_cached_block(block)

    def reset_prefix_cache(self) -> bool:
        order = [self._primary[key] for key in self.policy.resident_keys()]
        if not super().reset_prefix_cache():
            return False
        # Every block is free (vLLM checked): the cached ones join the free queue in the
        # policy's eviction order, and the policy forgets everything, history included.
        self.free_block_queue.append_n(order)
        self._primary.clear()
        self._spare.clear()
        self._key_of = [None] * self.num_gpu_blocks
        self._num_evictable = 0
        self.policy.clear()
        return True

    # ------------------------------------------------------------------- live switch
    def switch_policy(self, name: str) -> EvictionPolicy:
        """Replace the policy by ``name``, carrying every resident key in recency order.

        Called between scheduler steps. Raises PolicyError (and changes nothing) for an
        unknown name. Ghost history does not carry over: the new policy starts it afresh.
        """
        new = make_policy(name, self.policy.capacity)
        for key in self.policy.resident_keys():
            new.find(key)
            new.insert(key)
            if self._primary[key].ref_cnt == 0:
                new.unpin(key)
        self.policy = new
        self.policy_switches += 1
        return new

    def prefix_cache_keys(self) -> set[Key]:
        """The keys vLLM's own prefix-cache map holds a block for: what a request can hit.

        Read from vLLM's ``cached_block_hash_to_block``, not from this class's bookkeeping, so
        a live switch can be checked against the pool itself (``verify`` checks that every one
        is a resident policy key; a resident key is missing here only while its block waits
        for its hash within an allocation).
        """
        return {key for key, blocks in self.cached_block_hash_to_block._cache.items() if blocks}

    # ------------------------------------------------------------- unsupported paths
    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[..., None]) -> None:
        raise UnsupportedVllmError("arc_evictor: BlockPool.unpin_blocks (HiSparse) is unsupported")

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedVllmError("arc_evictor: partial-block prefix caching is unsupported")

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        raise UnsupportedVllmError("arc_evictor: moving block hashes (CoW) is unsupported")

    # ------------------------------------------------------------------------ checks
    def verify(self) -> None:
        """Recount every invariant in the class docstring; AssertionError names the drift."""
        self.policy.verify()
        policy = self.policy
        assert set(self._primary) == set(policy.resident_keys()), (
            "policy resident keys and the pool's cached keys differ"
        )
        assert len(self._primary) == len(policy), "policy length differs from cached keys"
        # vLLM's own map may lack a key only while its block is pending (hash not yet set).
        untracked = self.prefix_cache_keys() - set(self._primary)
        assert not untracked, f"{len(untracked)} keys in vLLM's prefix cache but not the policy"
        assert len(self._key_of) == len(self.blocks), "block -> key table has the wrong size"
        key_of = {i: key for i, key in enumerate(self._key_of) if key is not None}
        in_queue = {b.block_id for b in self.free_block_queue.get_all_free_blocks()}
        evictable = 0
        copies_seen = 0
        for key, spares in self._spare.items():
            assert spares, f"key {key!r} kept with an empty list of spare copies"
            assert key in self._primary, f"key {key!r} has spare copies but no primary"
        for key, primary in self._primary.items():
            copies = [primary, *self._spare.get(key, ())]
            if primary.ref_cnt == 0:
                assert len(copies) == 1, f"key {key!r} has a free primary and other copies"
                evictable += 1
            for block in copies:
                copies_seen += 1
                assert key_of.get(block.block_id) == key, (
                    f"block {block.block_id} not mapped back to its key"
                )
                assert block.block_id not in in_queue, f"cached block {block.block_id} in queue"
                if block.block_hash is not None:
                    assert block.block_hash == key, f"block {block.block_id} hash != its key"
        assert copies_seen == len(key_of), "a block maps to a key that does not hold it"
        assert evictable == self._num_evictable, (
            f"evictable count {self._num_evictable} != recount {evictable}"
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
            if block.block_hash is not None:
                assert block.block_id in key_of, f"hashed block {block.block_id} untracked"
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
