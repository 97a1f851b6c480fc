"""ARC: Adaptive Replacement Cache (Megiddo & Modha, FAST'03), and DBL.

Variant: the paper's Figure 4, exactly, with a float target ``p`` in [0, c]:
a B1 ghost hit raises ``p`` by max(1, |B2|/|B1|), a B2 ghost hit lowers it by
max(1, |B1|/|B2|), and the key goes to T2. REPLACE evicts T1's LRU if T1 is
non-empty and (|T1| > p, or the key is in B2 and |T1| = p), else T2's LRU.
libCacheSim's ``ARC.c`` (0.3.5) does the same with a double ``p``, and the
oracle tests hold us to its hit counts exactly.

Adaptation to a block pool with pinning: REPLACE names a list; if that list has
no unpinned block, the victim is the other list's LRU unpinned block, and ``p``
does not move for that fallback. Recency inside T1 and T2 is release time, as in
vLLM; a pinned block leaves its list's order (it still counts in |T1| or |T2|)
and re-enters at the MRU end when released.

The paper's case IV directory bounds (|T1| + |B1| <= c, |T1|+|T2|+|B1|+|B2| <= 2c)
are restored after the insertion by dropping ghost LRUs; on the paper's own
traces this drops the very keys the paper drops before REPLACE.

DBL (the paper's DBL(2c) baseline, i.e. ARC with ``p`` frozen at c/2) is ARC
with adaptation turned off.

Name map (paper -> here): T1 ``_t1``, T2 ``_t2``, B1 ``_b1``, B2 ``_b2``,
p ``_p``, c ``capacity``; libCacheSim's L1_data/L1_ghost/L2_data/L2_ghost are
T1/B1/T2/B2.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from arc_evictor.policies.base import EvictionPolicy, Key
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics

# Final: mypyc inlines the constants instead of reading the module's globals on each use.
T1: Final = 0
T2: Final = 1
B1: Final = 2
B2: Final = 3
_LIST_NAMES: Final = ("t1", "t2", "b1", "b2")
_NONE: Final = object()


class GhostList:
    """Ghost keys, least recently evicted first: append, remove and pop the oldest in O(1).

    The entries are ``_queue[_head:]``, oldest first: popping advances ``_head``, and the
    consumed prefix is cut off in one pass once it outgrows the entries (a list indexed by
    compiled code, where a deque would cost a method call per operation). A removed key's
    entry stays, marked stale, until it reaches the front or the entries are compacted:
    cheaper than an ``OrderedDict``, which links a node per key.

    Invariants (``verify``):
    - ``len(self)`` counts the live keys, each once;
    - a key's ``_stale[key]`` stale entries all come before its live entry, if it has one,
      so the first entry of a key that is not stale is its live one;
    - the entries number at most twice the live keys plus ``COMPACT_SLACK``;
    - the consumed prefix is at most ``COMPACT_SLACK`` or the number of entries.
    """

    COMPACT_SLACK: Final = 64

    def __init__(self) -> None:
        self._queue: list[Key] = []
        self._head = 0
        self._stale: dict[Key, int] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Key]:
        """The live keys, least recently evicted first."""
        skip = dict(self._stale)
        queue = self._queue
        for index in range(self._head, len(queue)):
            key = queue[index]
            stale = skip.get(key, 0)
            if stale:
                skip[key] = stale - 1
            else:
                yield key

    def append(self, key: Key) -> None:
        """``key``, not in the list, becomes its most recently evicted ghost."""
        self._queue.append(key)
        self._size += 1

    def remove(self, key: Key) -> None:
        """Drop ``key``, which is in the list."""
        self._size -= 1
        self._stale[key] = self._stale.get(key, 0) + 1
        if len(self._queue) - self._head > 2 * self._size + self.COMPACT_SLACK:
            self._queue = list(self)
            self._head = 0
            self._stale.clear()

    def pop_oldest(self) -> Key:
        """Drop and return the least recently evicted key; the list is not empty."""
        queue, stale = self._queue, self._stale
        head = self._head
        while True:
            key = queue[head]
            head += 1
            count = stale.get(key, 0) if stale else 0
            if not count:
                break
            if count == 1:
                del stale[key]
            else:
                stale[key] = count - 1
        if head > self.COMPACT_SLACK and 2 * head > len(queue):
            del queue[:head]
            head = 0
        self._head = head
        self._size -= 1
        return key

    def clear(self) -> None:
        self._queue.clear()
        self._head = 0
        self._stale.clear()
        self._size = 0

    def verify(self) -> None:
        live = list(self)
        entries = len(self._queue) - self._head
        assert len(live) == self._size == len(set(live)), "ghost list count out of step"
        assert entries <= 2 * self._size + self.COMPACT_SLACK, "ghost queue not compacted"
        assert self._head <= max(self.COMPACT_SLACK, entries), "ghost queue prefix not cut off"


class ARC(EvictionPolicy, ReportsStatistics):
    """ARC over a block pool with pinned blocks.

    Invariants:
    - ``_where`` maps every directory key (resident or ghost) to T1, T2, B1 or B2;
    - ``_t1``/``_t2`` hold exactly the unpinned keys of T1/T2, ordered by release
      (value = release stamp, increasing); ``_pinned`` holds the pinned resident keys;
    - ``_t1_size``/``_t2_size`` count T1/T2 including pinned keys, and
      ``_t1_size + _t2_size <= capacity``;
    - ``_b1``/``_b2`` hold the ghost keys, least recently evicted first;
    - ``_t1_size + len(_b1) <= capacity`` and ``len(_where) <= 2 * capacity``
      after every insert;
    - ``0 <= _p <= capacity``.
    """

    name = "arc"
    resident_lists = ("t1", "t2")
    ghost_lists = ("b1", "b2")

    def __init__(self, capacity: int, *, adaptive: bool = True) -> None:
        super().__init__(capacity)
        self.counters = PolicyCounters()
        self.adaptive = adaptive
        self._where: dict[Key, int] = {}
        self._t1: OrderedDict[Key, int] = OrderedDict()
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._b1 = GhostList()
        self._b2 = GhostList()
        self._pinned: set[Key] = set()
        self._t1_size = 0
        self._t2_size = 0
        self._p: float = 0.0 if adaptive else capacity / 2
        # Ghost list of the key that missed in the last ``find`` (B1, B2) or None.
        self._pending_ghost: int | None = None
        self._clock = 0

    @property
    def target(self) -> float:
        return self._p

    def describe(self) -> str:
        return "arc" if self.adaptive else "dbl"

    def find(self, key: Key) -> bool:
        where = self._where.get(key)
        if where is None:
            self._pending_ghost = None
            return False
        if where == T1:
            self._t1_size -= 1
            self._t2_size += 1
            self._where[key] = T2
            stamp = self._t1.pop(key, _NONE)
            if stamp is not _NONE:
                self._clock += 1
                self._t2[key] = self._clock
            return True
        if where == T2:
            if key in self._t2:
                self._clock += 1
                self._t2[key] = self._clock
                self._t2.move_to_end(key)
            return True
        # A ghost hit: a miss that tells which list should have been larger.
        n_b1, n_b2 = len(self._b1), len(self._b2)
        ghost_hits = self.counters.ghost_hits  # counted inline: a miss's path
        if where == B1:
            ghost_hits["b1"] = ghost_hits.get("b1", 0) + 1
            if self.adaptive:
                self._p = min(self._p + max(n_b2 / n_b1, 1.0), float(self.capacity))
            self._b1.remove(key)
        else:
            ghost_hits["b2"] = ghost_hits.get("b2", 0) + 1
            if self.adaptive:
                self._p = max(self._p - max(n_b1 / n_b2, 1.0), 0.0)
            self._b2.remove(key)
        del self._where[key]
        self._pending_ghost = where
        return False

    def access(self, key: Key) -> bool:
        # A hit inline (no pins, so the key is in _t1 or _t2); a miss by the plain calls.
        where = self._where.get(key)
        if where is not None and where <= T2:
            self._clock += 1
            if where == T1:
                del self._t1[key]
                self._t1_size -= 1
                self._t2_size += 1
                self._where[key] = T2
            else:
                self._t2.move_to_end(key)
            self._t2[key] = self._clock
            return True
        return EvictionPolicy.access(self, key)

    def insert(self, key: Key) -> None:
        assert key not in self._where, (
            f"insert of {key!r}, already in ARC list {self._where.get(key)}"
        )
        self._insert_new(key)

    def _insert_new(self, key: Key) -> None:
        """``insert`` of a key known to be outside the directory."""
        where = self._where
        capacity = self.capacity
        assert self._t1_size + self._t2_size < capacity, f"insert of {key!r} into a full ARC"
        if self._pending_ghost is None:
            where[key] = T1
            self._t1_size += 1
        else:
            where[key] = T2
            self._t2_size += 1
        self._pending_ghost = None
        self._pinned.add(key)
        # Case IV's directory bounds; only a fresh miss into T1 can break them.
        b1, b2 = self._b1, self._b2
        while len(b1) and self._t1_size + len(b1) > capacity:
            del where[b1.pop_oldest()]
        while len(where) > 2 * capacity and (len(b2) or len(b1)):
            del where[(b2 if len(b2) else b1).pop_oldest()]

    # The batched calls inline find, pin, insert and unpin's common paths, each looking a
    # key up once; every other path goes through the per-key calls.
    def touch(self, keys: Sequence[Key], newly_pinned: Sequence[bool]) -> None:
        where, pinned = self._where, self._pinned
        for index in range(len(keys)):
            key = keys[index]
            if not newly_pinned[index]:
                self.find(key)  # another request holds it already
                continue
            # pin, then find: a resident key leaves its order, and T1 moves to T2.
            if where[key] == T1:
                del self._t1[key]
                self._t1_size -= 1
                self._t2_size += 1
                where[key] = T2
            else:
                del self._t2[key]
            pinned.add(key)

    def allocate(
        self, keys: Sequence[Key | None], free: int, copy: Callable[[Key], Key]
    ) -> tuple[list[Key | None], list[Key]]:
        where = self._where
        entries: list[Key | None] = [None] * len(keys)
        victims: list[Key] = []
        from_t1 = 0  # evictions, counted once per call, whatever raises
        try:
            for index in range(len(keys) - 1, -1, -1):
                key = keys[index]
                resident = False
                if key is not None:
                    list_ = where.get(key)
                    if list_ is not None and list_ <= T2:
                        key = copy(key)
                        list_ = where.get(key)
                    if list_ is None:
                        self._pending_ghost = None  # find's plain miss
                    else:
                        # A ghost hit adapts p before the victim is chosen and leaves the
                        # directory; a resident copy entry is left for insert to refuse.
                        resident = self.find(key)
                if free:
                    free -= 1
                else:
                    order = self._replace_order()
                    if not order:
                        raise self.no_victim()
                    # to_evict and evict in one step: the victim is the order's head.
                    victim = order.popitem(last=False)[0]
                    from_t1 += self._to_ghost_from(victim, order is self._t1)
                    victims.append(victim)
                if key is not None:
                    if resident:
                        self.insert(key)
                    else:
                        self._insert_new(key)
                    entries[index] = key
        finally:
            self._count_evictions(from_t1, len(victims) - from_t1)
        return entries, victims

    def release(self, keys: Sequence[Key]) -> None:
        where, pinned, t1, t2 = self._where, self._pinned, self._t1, self._t2
        for key in keys:
            pinned.remove(key)
            self._clock += 1
            if where[key] == T1:
                t1[key] = self._clock
            else:
                t2[key] = self._clock

    def _replace_order(self) -> OrderedDict[Key, int]:
        """The unpinned order REPLACE evicts the head of: T1's or T2's, or the other one when
        that one has no unpinned key (the pinned fallback); empty when neither has one."""
        t1_size = self._t1_size
        if t1_size and (t1_size > self._p or (t1_size == self._p and self._pending_ghost == B2)):
            first, second = self._t1, self._t2
        else:
            first, second = self._t2, self._t1
        return first if first else second

    def to_evict(self) -> Key | None:
        return next(iter(self._replace_order()), None)

    def evict(self, key: Key) -> None:
        from_t1 = self._where[key] == T1
        del (self._t1 if from_t1 else self._t2)[key]
        self._to_ghost_from(key, from_t1)
        self._count_evictions(int(from_t1), int(not from_t1))

    def _to_ghost_from(self, key: Key, from_t1: bool) -> bool:
        """Evicted ``key``, already out of its order, becomes a B1 ghost if it was in T1, else
        a B2 ghost; returns ``from_t1``."""
        if from_t1:
            self._t1_size -= 1
            self._b1.append(key)
            self._where[key] = B1
        else:
            self._t2_size -= 1
            self._b2.append(key)
            self._where[key] = B2
        return from_t1

    def _count_evictions(self, from_t1: int, from_t2: int) -> None:
        evictions = self.counters.evictions
        if from_t1:
            evictions["t1"] = evictions.get("t1", 0) + from_t1
        if from_t2:
            evictions["t2"] = evictions.get("t2", 0) + from_t2

    def remove(self, key: Key) -> None:
        # Check before changing anything: a pinned key is in neither order, a ghost in
        # neither T1 nor T2; both raise KeyError and leave the directory intact.
        where = self._where[key]
        if where == T1:
            del self._t1[key]
            self._t1_size -= 1
        elif where == T2:
            del self._t2[key]
            self._t2_size -= 1
        else:
            raise KeyError(key)
        del self._where[key]

    def pin(self, key: Key) -> None:
        if self._where[key] == T1:
            del self._t1[key]
        else:
            del self._t2[key]
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.remove(key)
        self._clock += 1
        if self._where[key] == T1:
            self._t1[key] = self._clock
        else:
            self._t2[key] = self._clock

    def __contains__(self, key: object) -> bool:
        where = self._where.get(key)
        return where is not None and where <= T2

    def __len__(self) -> int:
        return self._t1_size + self._t2_size

    def resident_keys(self) -> Iterator[Key]:
        yield from self.released()
        yield from self._pinned

    def released(self) -> Iterator[Key]:
        """Unpinned resident keys (T1 and T2), least recently released first."""
        by_release = heapq.merge(self._t1.items(), self._t2.items(), key=lambda item: item[1])
        for key, _stamp in by_release:
            yield key

    def least_recently_released(self) -> Key | None:
        """LRU's victim: the older of T1's and T2's least recently released keys; no change."""
        t1, t2 = self._t1, self._t2
        if not t1 or not t2:
            return next(iter(t1 or t2), None)
        first1, first2 = next(iter(t1)), next(iter(t2))
        return first1 if t1[first1] < t2[first2] else first2

    def list_of(self, key: Key) -> str | None:
        """The list that holds ``key`` (``t1``, ``t2``, ``b1`` or ``b2``), or None."""
        where = self._where.get(key)
        return None if where is None else _LIST_NAMES[where]

    def reload(
        self,
        released: Iterable[tuple[Key, bool]],
        pinned: Iterable[tuple[Key, bool]],
        ghosts_newest_first: Iterable[tuple[Key, bool]],
        target: float,
    ) -> None:
        """Replace every list and ``p``, for an owner that kept the keys in another order.

        Each key comes with whether it belongs to the frequency side (T2 or B2) rather
        than the recency side (T1 or B1): the ``released`` keys least recently released
        first, then the ``pinned`` ones. Ghosts are taken newest first while the case IV
        bounds hold: one that would push |T1| + |B1| past c is skipped, and the first that
        would push the directory past 2c ends the list. The counters keep counting.
        """
        self.clear()
        where, t1, t2 = self._where, self._t1, self._t2
        for key, frequent in released:
            self._clock += 1
            if frequent:
                where[key], t2[key] = T2, self._clock
            else:
                where[key], t1[key] = T1, self._clock
        for key, frequent in pinned:
            where[key] = T2 if frequent else T1
            self._pinned.add(key)
        self._t2_size = sum(1 for list_ in where.values() if list_ == T2)
        self._t1_size = len(where) - self._t2_size
        capacity = self.capacity
        kept: list[tuple[Key, bool]] = []
        t1_and_b1 = self._t1_size
        for key, frequent in ghosts_newest_first:
            if len(where) + len(kept) == 2 * capacity:
                break
            if not frequent:
                if t1_and_b1 == capacity:
                    continue
                t1_and_b1 += 1
            kept.append((key, frequent))
        for key, frequent in reversed(kept):
            where[key] = B2 if frequent else B1
            (self._b2 if frequent else self._b1).append(key)
        self._p = target

    def list_sizes(self) -> dict[str, int]:
        return {"t1": self._t1_size, "t2": self._t2_size, "b1": len(self._b1), "b2": len(self._b2)}

    def clear(self) -> None:
        self._where.clear()
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._pinned.clear()
        self._t1_size = self._t2_size = 0
        self._p = 0.0 if self.adaptive else self.capacity / 2
        self._pending_ghost = None

    def verify(self) -> None:
        counts = [0, 0, 0, 0]
        for where in self._where.values():
            counts[where] += 1
        pinned_t1 = sum(1 for key in self._pinned if self._where.get(key) == T1)
        pinned_t2 = sum(1 for key in self._pinned if self._where.get(key) == T2)
        assert pinned_t1 + pinned_t2 == len(self._pinned), "a pinned ARC key is not resident"
        assert all(self._where.get(k) == T1 for k in self._t1), "_t1 holds a key not in T1"
        assert all(self._where.get(k) == T2 for k in self._t2), "_t2 holds a key not in T2"
        assert all(self._where.get(k) == B1 for k in self._b1), "_b1 holds a key not in B1"
        assert all(self._where.get(k) == B2 for k in self._b2), "_b2 holds a key not in B2"
        assert counts[T1] == self._t1_size == len(self._t1) + pinned_t1, (
            f"T1 count {self._t1_size} != directory {counts[T1]}"
        )
        assert counts[T2] == self._t2_size == len(self._t2) + pinned_t2, (
            f"T2 count {self._t2_size} != directory {counts[T2]}"
        )
        assert counts[B1] == len(self._b1) and counts[B2] == len(self._b2), (
            "ghost lists out of sync"
        )
        self._b1.verify()
        self._b2.verify()
        assert self._t1_size + self._t2_size <= self.capacity, "ARC holds more than c blocks"
        assert self._t1_size + len(self._b1) <= self.capacity, "|T1| + |B1| exceeds c"
        assert len(self._where) <= 2 * self.capacity, "ARC directory exceeds 2c"
        assert 0.0 <= self._p <= self.capacity, f"p = {self._p} outside [0, {self.capacity}]"
        for order in (self._t1, self._t2):
            stamps = list(order.values())
            assert stamps == sorted(stamps), "release stamps out of order in T1/T2"


class DBL(ARC):
    """DBL(2c): ARC's lists with ``p`` frozen at c/2 (two static LRU halves)."""

    name = "dbl"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, adaptive=False)
