"""LRU: evict the least recently released block.

This is vLLM's own prefix-cache order: a block enters the free queue's tail when
its last user releases it and is evicted from the head. Recency here is release
time, not lookup time; a pinned block has no place in the order until released.

Name map: ``_order`` is vLLM's ``FreeKVCacheBlockQueue`` restricted to hashed
blocks (head = least recently released).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from arc_evictor.policies.base import EvictionPolicy, Key, mypyc_attr
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics


# The simulator's online bound subclasses it in plain Python.
@mypyc_attr(allow_interpreted_subclasses=True)
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

    # The batched calls inline: LRU's find changes nothing, so each is a few dict operations.
    def touch(self, keys: Sequence[Key], newly_pinned: Sequence[bool]) -> None:
        order, pinned = self._order, self._pinned
        for index in range(len(keys)):
            if newly_pinned[index]:
                key = keys[index]
                del order[key]
                pinned.add(key)

    def allocate(
        self, keys: Sequence[Key | None], free: int, copy: Callable[[Key], Key]
    ) -> tuple[list[Key | None], list[Key]]:
        order, pinned = self._order, self._pinned
        entries: list[Key | None] = [None] * len(keys)
        victims: list[Key] = []
        for index in range(len(keys) - 1, -1, -1):
            key = keys[index]
            if key is not None and (key in order or key in pinned):
                key = copy(key)  # before the eviction, as ``find`` comes first
            if free:
                free -= 1
            elif order:
                victim = order.popitem(last=False)[0]
                victims.append(victim)
            else:
                raise self.no_victim()
            if key is not None:
                pinned.add(key)
                entries[index] = key
        if victims:
            evictions = self.counters.evictions
            evictions["lru"] = evictions.get("lru", 0) + len(victims)
        return entries, victims

    def release(self, keys: Sequence[Key]) -> None:
        order, pinned = self._order, self._pinned
        for key in keys:
            pinned.remove(key)
            order[key] = None

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
