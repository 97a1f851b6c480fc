"""LFU with remembered counts: the frequency expert inside ``trio`` (not registered alone).

Variant: in-cache LFU (Karedla et al., "Caching Strategies to Improve Disk System
Performance", 1994) with two changes. A key's count is its number of accesses
(``find`` calls), capped at ``MAX_COUNT``, and the count of an evicted key is
remembered in a bounded history (``history_limit`` keys, oldest eviction forgotten
first), so a document that is read often but not back to back still wins against
one read once. Ties go to the least recently released key.

On its own LFU loses to LRU on conversations and the Mooncake sample (README, "Which
policy to use"); ``trio`` uses it only while its miniature is ahead.

Prefix caches: every request that uses a block also uses its parent, so a parent's
count is at least its child's, and with ties broken by release order (children are
released first) a head does not leave before its tail.

Cost: O(1) per operation; finding the lowest non-empty count after one empties
scans at most ``MAX_COUNT`` counts. An owner that needs the order only now and then
(``trio``) keeps counts always and builds the order on demand (``start_order``).

Name map: ``_buckets`` count -> unpinned keys of that count (with release stamps from
``_clock``); ``counts`` resident keys' counts; ``_history`` evicted keys' counts;
``_min`` the lowest bucket.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Final

from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics

# Counts above this carry no extra information: the hottest blocks never leave anyway.
MAX_COUNT: Final = 255


class FrequencyOrder:
    """Unpinned resident keys ordered by (count, release), and every key's count.

    Invariants (checked by ``verify``):
    - ``counts`` maps every resident key, pinned or not, to its count in [1, MAX_COUNT]
      (public: while not ``ordered`` an owner may raise a resident key's count itself,
      as ``trio``'s hot path does, saving a call per block);
    - while ``ordered``: ``_buckets`` maps each count to a non-empty order of exactly
      the unpinned resident keys with that count, least recently released first (value:
      a release stamp from ``_clock``, increasing); otherwise ``_buckets`` is empty;
    - ``_history`` holds at most ``history_limit`` evicted keys' counts, none resident,
      oldest eviction first;
    - ``_min`` is the smallest key of ``_buckets`` when it is not empty.
    """

    def __init__(self, history_limit: int, *, ordered: bool = True) -> None:
        if history_limit < 0:
            raise PolicyError(f"LFU history limit must be >= 0, got {history_limit}")
        self.history_limit = history_limit
        self.ordered = ordered
        self.counts: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, int]] = {}
        self._history: OrderedDict[Key, int] = OrderedDict()
        self._min = 0
        self._clock = 0
        self._pending = 0  # count of the key that missed in the last ``access``

    def __contains__(self, key: object) -> bool:
        """True if ``key`` is resident."""
        return key in self.counts

    def __len__(self) -> int:
        return len(self.counts)

    def resident(self) -> set[Key]:
        """A copy of the resident keys (for checks)."""
        return set(self.counts)

    def count(self, key: Key) -> int:
        """The remembered count of ``key`` (resident or in the history), else 0."""
        return self.counts.get(key) or self._history.get(key, 0)

    def access(self, key: Key) -> None:
        """One more use of ``key``; a key that is not resident becomes the pending one."""
        count = self.counts.get(key)
        if count is None:
            self._pending = min(self._history.pop(key, 0) + 1, MAX_COUNT)
            return
        if count == MAX_COUNT:
            return
        self.counts[key] = count + 1
        bucket = self._buckets.get(count)
        if bucket is not None and key in bucket:
            # Only the plain driver finds an unpinned key; the pool pins first.
            self._unlink(key, count, bucket)
            self._link(key, count + 1)

    def add(self, key: Key) -> None:
        """The pending key is resident now (and pinned: in no bucket)."""
        self.counts[key] = self._pending or 1
        self._pending = 0

    def start_order(self, unpinned: Iterable[Key]) -> None:
        """Build the order from every unpinned resident key, least recently released first."""
        assert not self.ordered, "the LFU order is built already"
        self.ordered = True
        for key in unpinned:
            self._link(key, self.counts[key])

    def stop_order(self) -> None:
        """Drop the order (counts and history stay): ``hold`` and ``release`` may stop."""
        self.ordered = False
        self._buckets.clear()

    def hold(self, key: Key) -> None:
        """``key`` is pinned: out of the order, count kept (only while ordered)."""
        count = self.counts[key]
        self._unlink(key, count, self._buckets[count])

    def release(self, key: Key) -> None:
        """``key`` is unpinned: back in the order, the most recent of its count (while
        ordered)."""
        self._link(key, self.counts[key])

    def drop(self, key: Key, *, remember: bool) -> None:
        """Unpinned ``key`` leaves the cache; ``remember`` keeps its count in the history."""
        count = self.counts.pop(key)
        if self.ordered:
            self._unlink(key, count, self._buckets[count])
        if remember and self.history_limit:
            self._history[key] = count
            if len(self._history) > self.history_limit:
                self._history.popitem(last=False)

    def first(self) -> Key | None:
        """The least frequently used unpinned key (oldest release among ties); no change."""
        bucket = self._buckets.get(self._min)
        if bucket is None:
            return None
        for key in bucket:
            return key
        return None

    def unpinned(self) -> Iterator[Key]:
        """Unpinned resident keys, victims first."""
        for count in sorted(self._buckets):
            yield from self._buckets[count]

    def history_newest_first(self) -> Iterator[tuple[Key, int]]:
        """Evicted keys with their remembered counts, most recently evicted first."""
        return reversed(self._history.items())

    def released(self) -> Iterator[Key]:
        """Unpinned resident keys, least recently released first."""
        by_release = heapq.merge(
            *(bucket.items() for bucket in self._buckets.values()), key=lambda item: item[1]
        )
        for key, _stamp in by_release:
            yield key

    def clear(self) -> None:
        self.counts.clear()
        self._buckets.clear()
        self._history.clear()
        self._min = 0
        self._pending = 0

    def _link(self, key: Key, count: int) -> None:
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            if len(self._buckets) == 1 or count < self._min:
                self._min = count
        self._clock += 1
        bucket[key] = self._clock

    def _unlink(self, key: Key, count: int, bucket: OrderedDict[Key, int]) -> None:
        del bucket[key]
        if not bucket:
            del self._buckets[count]
            if count == self._min and self._buckets:
                while self._min not in self._buckets:
                    self._min += 1

    def verify(self, unpinned: set[Key], pinned: set[Key]) -> None:
        """Check the invariants against the owner's unpinned and pinned resident keys."""
        assert set(self.counts) == unpinned | pinned, "LFU counts differ from resident keys"
        in_buckets: set[Key] = set()
        for count, bucket in self._buckets.items():
            assert bucket, f"LFU keeps an empty bucket for count {count}"
            for key in bucket:
                assert self.counts[key] == count, f"LFU key {key!r} sits in the wrong bucket"
                in_buckets.add(key)
            stamps = list(bucket.values())
            assert stamps == sorted(stamps), f"LFU bucket {count} out of release order"
        if self.ordered:
            assert in_buckets == unpinned, "LFU buckets differ from the unpinned resident keys"
        else:
            assert not self._buckets, "LFU keeps buckets while not ordered"
        assert all(1 <= c <= MAX_COUNT for c in self.counts.values()), "LFU count out of range"
        assert len(self._history) <= self.history_limit, "LFU history exceeds its limit"
        assert not self._history.keys() & self.counts.keys(), "a resident key is in LFU history"
        if self._buckets:
            assert self._min == min(self._buckets), f"LFU minimum {self._min} is stale"


class LFU(EvictionPolicy, ReportsStatistics):
    """LFU with remembered counts over a pool with pinned blocks (see the module docstring).

    Invariants: those of ``FrequencyOrder``; ``_pinned`` holds exactly the pinned
    resident keys; resident keys never exceed ``capacity``.
    """

    name = "lfu"
    resident_lists = ("lfu",)

    def __init__(self, capacity: int, *, history_factor: int = 4) -> None:
        super().__init__(capacity)
        self.counters = PolicyCounters()
        if history_factor < 0:
            raise PolicyError(f"LFU history factor must be >= 0, got {history_factor}")
        self._order = FrequencyOrder(history_factor * capacity)
        self._pinned: set[Key] = set()

    def find(self, key: Key) -> bool:
        self._order.access(key)
        return key in self._order

    def access(self, key: Key) -> bool:
        order = self._order
        order.access(key)  # an unpinned key moves to its new count's bucket
        counts = order.counts  # the dict itself: this runs for every sampled key in trio
        if key in counts:
            return True
        if len(counts) == self.capacity:
            order.drop(order.first(), remember=True)
            self.counters.count_eviction("lfu")
        order.add(key)
        order.release(key)
        return False

    def insert(self, key: Key) -> None:
        assert len(self) < self.capacity, f"insert of {key!r}: LFU full"
        self._order.add(key)
        self._pinned.add(key)

    def to_evict(self) -> Key | None:
        return self._order.first()

    def evict(self, key: Key) -> None:
        self._order.drop(key, remember=True)
        self.counters.count_eviction("lfu")

    def remove(self, key: Key) -> None:
        if key in self._pinned or key not in self._order:
            raise KeyError(key)
        self._order.drop(key, remember=False)

    def pin(self, key: Key) -> None:
        self._order.hold(key)
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.remove(key)
        self._order.release(key)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def resident_keys(self) -> Iterator[Key]:
        yield from self._order.unpinned()
        yield from self._pinned

    def list_sizes(self) -> dict[str, int]:
        return {"lfu": len(self)}

    def verify(self) -> None:
        resident = self._order.resident()
        self._order.verify(resident - self._pinned, self._pinned)
        assert len(resident) <= self.capacity, "LFU holds more than its capacity"

    def clear(self) -> None:
        self._order.clear()
        self._pinned.clear()
