"""A model of vLLM's KV block pool: fixed capacity, reference counts, a policy.

The pool owns counts and pins; the policy owns the order of cached blocks
(``arc_evictor.policies.base``). A block that holds no cached key is free and
is always reused before any cached block is evicted, as in vLLM, so eviction
starts only when every block holds a cached key.
"""

from __future__ import annotations

from collections.abc import Sequence

from arc_evictor.policies.base import EvictionPolicy, Key, refuse_copy


class PoolExhausted(ValueError):
    """No free block and no unpinned cached block: every block is in use."""


class BlockPool:
    """``capacity`` blocks, cached keys ordered by ``policy``.

    Invariants:
    - ``_cached`` is exactly the set of keys resident in ``policy`` (the pool
      keeps its own copy so that membership tests on the hot path cost no call);
    - ``_refs`` maps exactly the keys with a reference count above zero to that
      count, and exactly those keys are pinned in the policy;
    - free blocks = ``capacity - len(_cached)``; evictable = cached - pinned.

    A cached key is pinned before the policy's ``find`` sees it, so a policy
    never re-orders a block only for ``pin`` to take it out of its order.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.capacity = policy.capacity
        self._cached: set[Key] = set()  # owned by the pool, mirrors the policy's residents
        self._refs: dict[Key, int] = {}  # owned by the pool; the policy sees 0 <-> 1 changes
        self.evictions = 0

    @property
    def num_pinned(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free(self) -> int:
        return self.capacity - len(self._cached)

    def is_cached(self, key: Key) -> bool:
        return key in self._cached

    def is_pinned(self, key: Key) -> bool:
        return key in self._refs

    def prefix_hits(self, keys: Sequence[Key]) -> int:
        """Length of the longest cached prefix of ``keys``; changes nothing."""
        cached = self._cached
        for position, key in enumerate(keys):
            if key not in cached:
                return position
        return len(keys)

    def blocks_to_pin(self, keys: Sequence[Key]) -> int:
        """How many more blocks would be pinned if a request took ``keys``."""
        refs = self._refs
        return sum(1 for key in keys if key not in refs)

    def _cache_misses(self, keys: list[Key]) -> None:
        """Cache ``keys`` (head first, none of them cached), evicting once no block is free."""
        cached = self._cached
        _entries, victims = self.policy.allocate(keys, self.capacity - len(cached), refuse_copy)
        cached.difference_update(victims)
        self.evictions += len(victims)
        cached.update(keys)
        self._refs.update(dict.fromkeys(keys, 1))

    def remove(self, key: Key) -> None:
        """Drop cached, unpinned ``key`` without history (prefix-cache reset)."""
        if key in self._refs:
            raise ValueError(f"cannot remove {key!r}: a request holds it")
        self.policy.remove(key)
        self._cached.remove(key)

    def _check_fits(self, keys: Sequence[Key]) -> None:
        """Raise PoolExhausted unless the pool can pin every block of ``keys`` at once."""
        pinned = len(self._refs)
        # The exact count walks the request; most requests pass the cheap bound.
        if pinned + len(keys) > self.capacity and pinned + self.blocks_to_pin(keys) > self.capacity:
            raise PoolExhausted(
                f"a request of {len(keys)} blocks does not fit: {pinned} of "
                f"{self.capacity} blocks are pinned"
            )

    def take(self, keys: Sequence[Key], max_hits: int | None = None) -> int:
        """A request takes its blocks; returns its prefix-cache hits in blocks.

        The order is vLLM's: first the cached prefix is taken (pinned, then
        found), as vLLM's ``touch`` does; then every other block already cached,
        so the request's own misses cannot evict them; then the misses are
        cached. Each pass goes tail first (last block first), as the sequential
        mode states (docs/architecture.md, "Policy semantics"). The hit count is
        the cached prefix before any of this, the first miss ending it, and at
        most ``max_hits``: vLLM always computes a prompt's last token, so a fully
        cached prompt's last block is taken with the other cached blocks, not as
        a hit.

        Raises PoolExhausted, before changing anything, when the pool cannot pin
        every block of the request at once.
        """
        self._check_fits(keys)
        hits = self.prefix_hits(keys)
        if max_hits is not None:
            hits = min(hits, max_hits)
        cached = self._cached
        refs = self._refs
        rest = keys[hits:]
        # The cached blocks in one policy call, tail first: the prefix, then the others. Past
        # the first miss a prompt rarely holds a cached block: that case costs C-level passes.
        others_cached = not cached.isdisjoint(rest)
        taken = list(reversed(keys[:hits]))
        if others_cached:
            taken += [key for key in reversed(rest) if key in cached]
        if refs:
            newly_pinned = []
            for key in taken:
                count = refs.get(key, 0)
                newly_pinned.append(not count)
                refs[key] = count + 1
        else:  # nothing held (always so in sequential mode): every block is pinned anew
            newly_pinned = [True] * len(taken)
            refs.update(dict.fromkeys(taken, 1))
        if taken:
            self.policy.touch(taken, newly_pinned)
        misses = [key for key in rest if key not in cached] if others_cached else list(rest)
        if misses:
            self._cache_misses(misses)
        return hits

    def serve_alone(self, keys: Sequence[Key], max_hits: int) -> int:
        """``take`` then ``give_back`` of distinct ``keys``; returns the prefix-cache hits.

        While no request holds a block (always so in sequential mode) the whole request is
        one policy call (``EvictionPolicy.serve_alone``), which makes the calls ``take`` and
        ``give_back`` would.
        """
        if self._refs:
            hits = self.take(keys, max_hits)
            self.give_back(keys)
            return hits
        self._check_fits(keys)
        hits, cached, victims = self.policy.serve_alone(keys, max_hits)
        self._cached.difference_update(victims)
        self._cached.update(cached)
        self.evictions += len(victims)
        return hits

    def give_back(self, keys: Sequence[Key]) -> None:
        """A finished request releases its blocks tail first, as vLLM does."""
        refs = self._refs
        if len(refs) == len(keys) and sum(refs.values()) == len(keys):
            # Only this request holds blocks (always so in sequential mode; its keys are
            # distinct and all held): every block is released.
            refs.clear()
            self.policy.release(keys[::-1])
            return
        released = []
        for key in reversed(keys):
            count = refs[key]
            if count == 1:
                del refs[key]
                released.append(key)
            else:
                refs[key] = count - 1
        self.policy.release(released)

    def verify(self) -> None:
        """Check the pool's invariants, then the policy's."""
        policy = self.policy
        assert len(self._cached) == len(policy), (
            f"pool caches {len(self._cached)} keys, policy holds {len(policy)}"
        )
        for key in self._cached:
            assert key in policy, f"cached key {key!r} is not resident in the policy"
        for key, refs in self._refs.items():
            assert refs > 0, f"key {key!r} kept with reference count {refs}"
            assert key in self._cached, f"pinned key {key!r} is not cached"
        assert len(self._cached) <= self.capacity, "pool holds more keys than blocks"
        policy.verify()
