"""LRU: evict the least recently released block.

This is vLLM's own prefix-cache order: a block enters the free queue's tail when
its last user releases it and is evicted from the head. Recency here is release
time, not lookup time; a pinned block has no place in the order until released.

Name map: ``_order`` is vLLM's ``FreeKVCacheBlockQueue`` restricted to hashed
blocks (head = least recently released).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from arc_evictor.policies.base import EvictionPolicy, Key
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics


class LRU(EvictionPolicy, ReportsStatistics):
    """Least recently released first.

    Invariants:
    - ``_order`` holds exactly the unpinned resident keys, oldest release first;
    - ``_pinned`` holds exactly the pinned resident keys;
    - the two are disjoint and together hold at most ``capacity`` keys.
    """

    name = "lru"
    resident_lists = ("lru",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.counters = PolicyCounters()
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._pinned: set[Key] = set()

    def find(self, key: Key) -> bool:
        return key in self._order or key in self._pinned

    def insert(self, key: Key) -> None:
        assert len(self._order) + len(self._pinned) < self.capacity, f"insert of {key!r}: LRU full"
        self._pinned.add(key)

    def access(self, key: Key) -> bool:
        order = self._order
        if key in order:
            order.move_to_end(key)
            return True
        if len(order) == self.capacity:
            order.popitem(last=False)
            self.counters.count_eviction("lru")
        order[key] = None
        return False

    def to_evict(self) -> Key | None:
        return next(iter(self._order), None)

    def evict(self, key: Key) -> None:
        del self._order[key]
        self.counters.count_eviction("lru")

    def remove(self, key: Key) -> None:
        del self._order[key]

    def pin(self, key: Key) -> None:
        del self._order[key]
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.remove(key)
        self._order[key] = None

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def resident_keys(self) -> Iterator[Key]:
        # Pinned keys are in use right now: the most recent of all.
        yield from self._order
        yield from self._pinned

    def list_sizes(self) -> dict[str, int]:
        return {"lru": len(self)}

    def clear(self) -> None:
        self._order.clear()
        self._pinned.clear()

    def verify(self) -> None:
        both = self._pinned.intersection(self._order)
        assert not both, f"LRU keys both pinned and evictable: {sorted(map(repr, both))[:5]}"
        assert len(self) <= self.capacity, f"LRU holds {len(self)} > capacity {self.capacity}"
