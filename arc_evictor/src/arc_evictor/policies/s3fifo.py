"""S3-FIFO: a small probationary FIFO, a main FIFO and a ghost FIFO.

Paper: Yang, Zhang, Qiu, Yue, Rashmi, "FIFO queues are all you need for cache
eviction", SOSP'23.

Variant: libCacheSim's ``S3FIFO.c`` (not the original ``S3FIFOv0.c``), with its
defaults: the small FIFO holds 10% of the cache, the main FIFO the rest, the ghost
FIFO remembers 90% of the cache's worth of keys, and a block moves to main after
2 hits in small. In detail:

- a hit adds 1 to the block's counter (capped at 3; no block moves);
- a miss that hits the ghost goes to main; other misses go to small, except that
  before the first eviction a full small FIFO sends new blocks to main (this is
  what separates ``S3FIFO.c`` from ``S3FIFOv0.c``);
- to evict, take from main if main is over its share or small is empty, else
  from small. Small's oldest block moves to main (counter 0) if its counter
  reached the threshold, else it is evicted into the ghost; repeat until one is
  evicted. Main's oldest block with a counter f > 0 is re-queued with
  min(f, 3) - 1 (a 2-bit clock), else it is evicted (no ghost).

Differences from libCacheSim, both only for a cache under 20 blocks, where
libCacheSim 0.3.5 does not work with unit-size objects: it refuses any object at
least as large as the small FIFO, so from 10 to 19 blocks it caches nothing, and
under 10 blocks (a small FIFO of 0) it aborts the process. Here the small FIFO
holds at least 1 block and every block is admitted, since a pool caches what it
fills. From 20 blocks on the hit counts are identical (tests/policies/test_oracle.py).

Adaptation to a block pool with pinning: a pinned block keeps its place and its
counter; the scans pass it. If the chosen FIFO has no unpinned block to give, the
other one gives it (small's blocks that reached the threshold still move to main
first). ``to_evict`` computes the victim without moving anything; ``evict`` does
the moves. Cost: O(1) amortised per operation (each block a scan passes is either
moved out of small once or loses a counter unit that a hit paid for) plus the
pinned blocks the scans pass, at most the running batch's blocks per pass.

Name map (libCacheSim -> here): ``small_fifo`` ``_small``, ``main_fifo``
``_main``, ``ghost_fifo`` ``_ghost``, ``S3FIFO.freq`` the FIFO entry's value,
``hit_on_ghost`` ``_hit_on_ghost``, ``has_evicted`` ``_has_evicted``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Final

from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics

# Main's counters act as a 2-bit clock: a re-queued block keeps at most 2 hits.
_MAIN_FREQ_CAP: Final = 3


class _Fifo:
    """A FIFO of keys, oldest first, each with a hit counter; ``capacity`` is its share."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[Key, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def push(self, key: Key, freq: int = 0) -> None:
        assert key not in self.entries, f"{key!r} is already queued"
        self.entries[key] = freq

    def requeue(self, key: Key, freq: int) -> None:
        """Move ``key`` to the newest end with counter ``freq``."""
        self.entries[key] = freq
        self.entries.move_to_end(key)


class _GhostFifo:
    """Keys recently evicted from small, oldest first; the oldest falls out at capacity."""

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: Key) -> None:
        if self.capacity == 0:
            return
        if len(self.keys) >= self.capacity:
            self.keys.popitem(last=False)
        self.keys[key] = None

    def discard(self, key: Key) -> bool:
        """Forget ``key``; True if it was there."""
        if key in self.keys:
            del self.keys[key]
            return True
        return False


class S3FIFO(EvictionPolicy, ReportsStatistics):
    """S3-FIFO over a block pool with pinned blocks.

    Invariants:
    - ``_small`` and ``_main`` are disjoint and hold exactly the resident keys,
      together at most ``capacity``;
    - ``_pinned`` is a subset of the resident keys;
    - ``_ghost`` holds no resident key and at most its capacity;
    - every counter is in [0, max(3, threshold)].
    """

    name = "s3fifo"
    resident_lists = ("small", "main")
    ghost_lists = ("ghost",)

    def __init__(
        self,
        capacity: int,
        *,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        # ``object``: checked below, so a float gets PolicyError, not the compiled core's
        # TypeError at the call.
        move_to_main_threshold: object = 2,
    ) -> None:
        super().__init__(capacity)
        self.counters = PolicyCounters()
        if not 0.0 < small_ratio < 1.0:
            raise PolicyError(f"s3fifo small_ratio must be in (0, 1), got {small_ratio}")
        if not ghost_ratio >= 0.0:
            raise PolicyError(f"s3fifo ghost_ratio must be at least 0, got {ghost_ratio}")
        if isinstance(move_to_main_threshold, bool) or not isinstance(move_to_main_threshold, int):
            raise PolicyError(
                f"s3fifo move_to_main_threshold must be an integer, got {move_to_main_threshold!r}"
            )
        if move_to_main_threshold < 1:
            raise PolicyError(
                f"s3fifo move_to_main_threshold must be at least 1, got {move_to_main_threshold}"
            )
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self.threshold = move_to_main_threshold
        # libCacheSim truncates both shares (C casts to int64).
        small_capacity = max(1, int(capacity * small_ratio))
        self._small = _Fifo(small_capacity)
        self._main = _Fifo(capacity - small_capacity)
        self._ghost = _GhostFifo(int(capacity * ghost_ratio))
        self._freq_cap = max(_MAIN_FREQ_CAP, move_to_main_threshold)
        self._pinned: set[Key] = set()
        # Whether the last ``find`` missed on a ghost key: its ``insert`` goes to main.
        self._hit_on_ghost = False
        self._has_evicted = False

    def describe(self) -> str:
        return f"s3fifo-{self.small_ratio:.2f}-{self.threshold}"

    def find(self, key: Key) -> bool:
        for fifo in (self._small, self._main):
            freq = fifo.entries.get(key)
            if freq is not None:
                fifo.entries[key] = min(freq + 1, self._freq_cap)
                return True
        self._hit_on_ghost = self._ghost.discard(key)
        if self._hit_on_ghost:
            self.counters.count_ghost_hit("ghost")
        return False

    def insert(self, key: Key) -> None:
        assert key not in self, f"insert of {key!r}, already resident in S3-FIFO"
        assert len(self) < self.capacity, f"insert of {key!r} into a full S3-FIFO"
        small = self._small
        if self._hit_on_ghost or (not self._has_evicted and len(small) >= small.capacity):
            self._main.push(key)
        else:
            small.push(key)
        self._hit_on_ghost = False
        self._pinned.add(key)

    def _scan_small(self) -> tuple[list[Key], Key | None]:
        """(unpinned keys small would promote to main first, small's victim or None)."""
        promoted: list[Key] = []
        for key, freq in self._small.entries.items():
            if key in self._pinned:
                continue
            if freq < self.threshold:
                return promoted, key
            promoted.append(key)
        return promoted, None

    def _main_victim(self, promoted: list[Key]) -> Key | None:
        """Main's victim, with ``promoted`` appended (counter 0): the first unpinned key
        with the smallest counter, since each full lap of the clock lowers all by 1."""
        best: Key | None = None
        best_freq = _MAIN_FREQ_CAP + 1
        for key, freq in self._main.entries.items():
            if key in self._pinned:
                continue
            if freq == 0:
                return key
            if min(freq, _MAIN_FREQ_CAP) < best_freq:
                best, best_freq = key, min(freq, _MAIN_FREQ_CAP)
        return promoted[0] if promoted else best

    def _plan(self) -> tuple[list[Key], Key | None, bool]:
        """(keys small promotes first, the victim, whether the victim leaves from small)."""
        main, small = self._main, self._small
        if len(main) > main.capacity or not small:
            victim = self._main_victim([])
            if victim is not None:
                return [], victim, False
            promoted, victim = self._scan_small()
        else:
            promoted, victim = self._scan_small()
        if victim is not None:
            return promoted, victim, True
        return promoted, self._main_victim(promoted), False

    def to_evict(self) -> Key | None:
        return self._plan()[1]

    def evict(self, key: Key) -> None:
        promoted, victim, from_small = self._plan()
        if victim is None or victim != key:
            raise PolicyError(f"S3-FIFO can evict only its next victim {victim!r}, not {key!r}")
        self._has_evicted = True
        for moved in promoted:
            del self._small.entries[moved]
            self._main.push(moved)
        if from_small:
            del self._small.entries[key]
            self._ghost.add(key)
            self.counters.count_eviction("small")
        else:
            self._evict_main(key)
            self.counters.count_eviction("main")

    def _evict_main(self, victim: Key) -> None:
        """Run main's clock until it evicts; it must stop at ``victim``."""
        entries = self._main.entries
        # Each lap lowers every unpinned counter (all <= 3) by one, so 4 laps suffice.
        for _lap in range(_MAIN_FREQ_CAP + 1):
            passed: list[Key] = []
            evicted = None
            for key, freq in entries.items():
                if key in self._pinned:
                    continue
                if freq == 0:
                    evicted = key
                    break
                passed.append(key)
            for key in passed:
                self._main.requeue(key, min(entries[key], _MAIN_FREQ_CAP) - 1)
            if evicted is not None:
                assert evicted == victim, f"S3-FIFO main evicts {evicted!r}, planned {victim!r}"
                del entries[evicted]
                return
        raise AssertionError(f"S3-FIFO main clock found no victim, planned {victim!r}")

    def remove(self, key: Key) -> None:
        if key in self._pinned:
            raise PolicyError(f"cannot remove pinned block {key!r}")
        for fifo in (self._small, self._main):
            if key in fifo:
                del fifo.entries[key]
                return
        raise KeyError(key)

    def pin(self, key: Key) -> None:
        if key not in self:
            raise KeyError(key)
        if key in self._pinned:
            raise PolicyError(f"pin of already pinned block {key!r}")
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        if key not in self:
            raise KeyError(key)
        if key not in self._pinned:
            raise PolicyError(f"unpin of block {key!r}, which is not pinned")
        self._pinned.remove(key)

    def __contains__(self, key: object) -> bool:
        return key in self._small.entries or key in self._main.entries

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def resident_keys(self) -> Iterator[Key]:
        # Small (seen once) before main, each oldest first; pinned blocks are in use
        # right now, so they come last.
        for fifo in (self._small, self._main):
            yield from (key for key in fifo.entries if key not in self._pinned)
        yield from self._pinned

    def list_sizes(self) -> dict[str, int]:
        return {"small": len(self._small), "main": len(self._main), "ghost": len(self._ghost)}

    def clear(self) -> None:
        self._small.entries.clear()
        self._main.entries.clear()
        self._ghost.keys.clear()
        self._pinned.clear()
        self._hit_on_ghost = False
        self._has_evicted = False

    def verify(self) -> None:
        small, main = self._small.entries, self._main.entries
        both = small.keys() & main.keys()
        assert not both, f"S3-FIFO keys in both small and main: {sorted(map(repr, both))[:5]}"
        assert len(self) <= self.capacity, f"S3-FIFO holds {len(self)} > {self.capacity}"
        stray = [key for key in self._pinned if key not in self]
        assert not stray, f"S3-FIFO pinned keys not resident: {stray[:5]}"
        haunted = [key for key in self._ghost.keys if key in self]
        assert not haunted, f"S3-FIFO ghost keys still resident: {haunted[:5]}"
        assert len(self._ghost) <= self._ghost.capacity, "S3-FIFO ghost over its capacity"
        for fifo in (small, main):
            bad = [f for f in fifo.values() if not 0 <= f <= self._freq_cap]
            assert not bad, f"S3-FIFO counters out of [0, {self._freq_cap}]: {bad[:5]}"
