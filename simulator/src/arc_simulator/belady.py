"""Belady's MIN (offline optimal): evict the block whose next use is furthest.

The simulator's upper bound, not a policy a server can run: it is built from the
whole trace. Every key's uses are the request indices that hold it, in order;
each ``find`` consumes the key's current use, so the simulator must call ``find``
exactly once per block of each request, in request order (it does: requests are
taken one at a time in sequential mode, and first-come first-served otherwise).

Variant: on a prefix cache MIN is not exactly optimal (a hit needs its whole
prefix), so this is the classic per-block bound. Victims come from a max-heap
with lazy deletion: O(log n) per operation, not O(1).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from arc_evictor.policies.base import EvictionPolicy, Key
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics

NEVER = 1 << 62  # next use of a key that is not used again


class Belady(EvictionPolicy, ReportsStatistics):
    """Furthest next use first, among unpinned cached keys.

    Invariants:
    - ``_next_use`` maps exactly the cached keys to the index of their next use;
    - ``_evictable`` holds exactly the unpinned cached keys; every one of them has
      a heap entry ``(-next_use, key)`` matching ``_next_use``; stale entries are
      dropped lazily when they reach the top.
    """

    name = "belady"
    resident_lists = ("belady",)

    def __init__(self, capacity: int, uses: dict[Key, deque[int]]) -> None:
        super().__init__(capacity)
        self.counters = PolicyCounters()
        self._uses = uses
        self._next_use: dict[Key, int] = {}
        self._evictable: set[Key] = set()
        self._heap: list[tuple[int, int, Key]] = []
        self._pushes = 0
        self._pending = NEVER

    @classmethod
    def for_requests(cls, capacity: int, requests: Iterable[Sequence[Key]]) -> Belady:
        """Build the oracle from every request's keys, in the order they will run."""
        uses: dict[Key, deque[int]] = {}
        for index, keys in enumerate(requests):
            for key in keys:
                uses.setdefault(key, deque()).append(index)
        return cls(capacity, uses)

    def skip(self, keys: Iterable[Key]) -> None:
        """A request that never ran (rejected): consume its uses without caching anything."""
        for key in keys:
            self._consume(key)

    def _consume(self, key: Key) -> int:
        queue = self._uses.get(key)
        if queue:
            queue.popleft()
        return queue[0] if queue else NEVER

    def find(self, key: Key) -> bool:
        next_use = self._consume(key)
        if key in self._next_use:
            self._next_use[key] = next_use
            if key in self._evictable:
                self._push(key, next_use)
            return True
        self._pending = next_use
        return False

    def _push(self, key: Key, next_use: int) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (-next_use, self._pushes, key))

    def insert(self, key: Key) -> None:
        self._next_use[key] = self._pending

    def to_evict(self) -> Key | None:
        heap = self._heap
        while heap:
            negative_use, _, key = heap[0]
            if key in self._evictable and self._next_use[key] == -negative_use:
                return key
            heapq.heappop(heap)  # stale: pinned, evicted or re-used since; not state
        return None

    def evict(self, key: Key) -> None:
        self.remove(key)
        self.counters.count_eviction("belady")

    def remove(self, key: Key) -> None:
        self._evictable.remove(key)
        del self._next_use[key]

    def pin(self, key: Key) -> None:
        self._evictable.remove(key)

    def unpin(self, key: Key) -> None:
        self._evictable.add(key)
        self._push(key, self._next_use[key])

    def __contains__(self, key: object) -> bool:
        return key in self._next_use

    def __len__(self) -> int:
        return len(self._next_use)

    def resident_keys(self) -> Iterator[Key]:
        yield from self._next_use

    def list_sizes(self) -> dict[str, int]:
        return {"belady": len(self._next_use)}

    def clear(self) -> None:
        self._next_use.clear()
        self._evictable.clear()
        self._heap.clear()

    def verify(self) -> None:
        assert self._evictable <= self._next_use.keys(), "an evictable Belady key is not cached"
        assert len(self._next_use) <= self.capacity, "Belady holds more than its capacity"
