"""Trio: ARC, LRU or LFU, whichever its miniature caches show ahead lately.

Why: no single order wins every workload a prefix cache sees. On document QA
(a Zipf law over long shared documents) the blocks worth keeping are the popular
documents', which only frequency with memory finds (LFU closes a third of the gap
to Belady there); on multi-turn chat recency wins (LRU or ARC); on the Mooncake
sample ARC does. An earlier candidate that chose between ARC and LRU only never closed any
of the gap to Belady; Trio adds LFU.

Variant: while ARC or LRU leads, the real cache is ARC exactly (arc.py: lists, ghosts,
target ``p``); LRU's victim is then the older of T1's and T2's least recently released
blocks (both lists are ordered by release stamp), and the victim goes to B1 or B2 as in
ARC, so ARC's learning goes on while LRU leads. While LFU leads, the real cache is
``lfu.FrequencyOrder`` ordered by (count, release), plus the set of keys ARC would hold
in T2 (hit since they entered); ARC's lists and ghosts are set aside, because keeping
them up to date as well cost about 0.4 of ARC's own time in ``make bench``. Access counts
(capped at 255, kept for ``history_factor * capacity`` evicted keys) are kept always, so
LFU leads with warm counts. When LFU loses the lead, ARC is rebuilt: T1 and T2 from that
set, each in release order; the ghosts from the count history, most recently evicted
first while ARC's bounds allow (used once: B1, else B2); and ``p`` from the miniature
ARC's target, scaled to the real capacity (keeping the old ``p`` instead lost up to 1.3
points on the Mooncake sample).

Three miniature caches (Waldspurger et al., "Cache Modeling and Optimization using
Miniature Simulations", USENIX ATC'17) replay a hash-sampled share of the keys, one
ARC, one LRU and one LFU, each with the sampled share of the capacity; the share is
the largest power of two that leaves each miniature at least ``MIN_MINIATURE_BLOCKS``
blocks (smaller miniatures misjudge prefix traffic). Every ``window`` sampled accesses
(half a miniature) each expert's score decays by ``SCORE_DECAY`` and gains its hits in
that window; the expert with the highest score (ties: ARC, then LRU, then LFU) leads
until the next window ends. The slow decay (a memory of about 20 windows) matters:
with scores halved each window, experts within a point of each other took turns, and
every turn cost hits (up to 0.8 points below max(LRU, ARC)).

Prefix caches: all three orders evict a block's descendants before the block
(LRU and ARC by release order, LFU because a parent's count is at least its
child's, ties by release order).

Cost: O(1) per operation, amortised: the leading order's work (ARC's or LFU's), one
count per ``find``, one multiplicative hash per missed ``find`` (a hit reads the key's
membership of the sampled resident keys instead), and a sampled share of the
work in three miniature caches (under 2,048 / c of the keys: every key below 2,048
blocks, 1/8 at 13,072). A change of lead between LFU and the others costs O(c): it
builds one order (merging ARC's two lists, or at most 255 count buckets) and, when ARC
comes back, reads at most ``history_factor * c`` remembered counts. It happens at most
once a window, and a window is about ``c / 2`` accesses.

Name map: ``_freq`` the counts and frequency order; ``_reused`` the keys ARC would
hold in T2 while LFU leads; ``_minis`` the miniatures (ARC, LRU, LFU); ``_scores``
their decayed hit counts; ``_expert`` the index of the expert that leads;
``_sampled_resident`` the resident keys in the sample.
"""

from __future__ import annotations

from collections.abc import Iterator

from arc_evictor.policies.arc import ARC, B1, B2, T1, T2
from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.lfu import LFU, MAX_COUNT, FrequencyOrder
from arc_evictor.policies.lru import LRU

# Fibonacci hashing: spreads interned (consecutive) integer keys over the sample space.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Each miniature holds at least this many blocks (caches below twice this sample every key).
MIN_MINIATURE_BLOCKS = 1024
# Per window, each expert's score is multiplied by this before its window hits are added.
SCORE_DECAY = 0.95
EXPERTS = ("arc", "lru", "lfu")
_ARC, _LRU, _LFU = 0, 1, 2


def _stable_hash(key: Key) -> int:
    """The same number for the same key in every process and replica.

    ``hash`` of bytes and str changes with PYTHONHASHSEED, and the vLLM plugin's keys are
    bytes, so sampling by ``hash`` would pick other keys after every restart.
    """
    return int.from_bytes(key[:8], "big") if key.__class__ is bytes else hash(key)


class Trio(ARC):
    """ARC's lists, or LFU's order while LFU leads; the lead from three miniatures.

    Invariants (all checked by ``verify``):
    - ``_freq`` counts every resident key; ``_pinned`` holds the pinned resident keys;
    - while ARC or LRU leads: ARC's invariants hold, ``_freq`` keeps no order and
      ``_reused`` is empty;
    - while LFU leads: ``_freq`` orders exactly the unpinned resident keys, ``_reused``
      holds only resident keys, ARC's lists and ghosts are empty, and
      ``0 <= _p <= capacity``;
    - the miniatures hold only sampled keys and are valid policies themselves;
    - ``_sampled_resident`` holds exactly the resident keys in the sample;
    - ``0 <= _window_count < window``; ``_expert`` is the best score as of the last
      window's end (ARC before the first).
    """

    name = "trio"

    def __init__(
        self,
        capacity: int,
        *,
        min_miniature_blocks: int = MIN_MINIATURE_BLOCKS,
        history_factor: int = 6,
    ) -> None:
        super().__init__(capacity)
        if min_miniature_blocks < 1:
            raise PolicyError(f"trio min_miniature_blocks must be >= 1, got {min_miniature_blocks}")
        if history_factor < 0:
            raise PolicyError(f"trio history_factor must be >= 0, got {history_factor}")
        # The largest power-of-two share that leaves each miniature min_miniature_blocks.
        self._sample_bits = min(16, max(0, (capacity // min_miniature_blocks).bit_length() - 1))
        # A key is sampled when its scrambled hash is below this (all keys: 2**64).
        self._sample_limit = 1 << (64 - self._sample_bits)
        mini_capacity = max(1, capacity >> self._sample_bits)
        self._minis = (
            ARC(mini_capacity),
            LRU(mini_capacity),
            LFU(mini_capacity, history_factor=history_factor),
        )
        # Half a miniature cache-full: the slow score decay, not the window, smooths the choice.
        self.window = max(64, mini_capacity // 2)
        self._freq = FrequencyOrder(history_factor * capacity, ordered=False)
        self._scores = [0.0, 0.0, 0.0]
        self._window_hits = [0, 0, 0]
        self._window_count = 0
        self._expert = _ARC
        # While LFU leads: the resident keys ARC would hold in T2 (hit since they entered).
        self._reused: set[Key] = set()
        # A hit asks this set instead of hashing the key (most accesses are hits).
        self._sampled_resident: set[Key] = set()
        # Whether the key that missed in the last ``find`` is in the sample.
        self._pending_sampled = False

    def describe(self) -> str:
        return f"trio-1/{1 << self._sample_bits}"

    @property
    def expert(self) -> str:
        """The expert that leads now: ``arc``, ``lru`` or ``lfu``."""
        return EXPERTS[self._expert]

    def _sampled(self, key: Key) -> bool:
        return (_stable_hash(key) * _GOLDEN) & _MASK64 < self._sample_limit

    # ARC's shorter path would skip the counts and the miniatures.
    access = EvictionPolicy.access

    def find(self, key: Key) -> bool:
        freq = self._freq
        counts = freq.counts
        count = counts.get(key)
        if count is None:
            # _sampled and _stable_hash inline: this runs for every missed block.
            hashed = int.from_bytes(key[:8], "big") if key.__class__ is bytes else hash(key)
            sampled = self._pending_sampled = (hashed * _GOLDEN) & _MASK64 < self._sample_limit
        else:
            sampled = key in self._sampled_resident
        if sampled:
            arc, lru, lfu = self._minis
            hits = self._window_hits
            hits[_ARC] += arc.access(key)
            hits[_LRU] += lru.access(key)
            hits[_LFU] += lfu.access(key)
            self._window_count += 1
            if self._window_count == self.window:
                self._end_window()
        if self._expert != _LFU:
            if count is None:
                ARC.find(self, key)  # a ghost hit moves p
                freq.access(key)  # the count comes back from the history
                return False
            # A hit: FrequencyOrder.access (no order to keep) and ARC.find's hit inline, a
            # call less per block; test_trio holds this copy to ARC's victims.
            if count < MAX_COUNT:
                counts[key] = count + 1
            if self._where[key] == T1:
                self._t1_size -= 1
                self._t2_size += 1
                self._where[key] = T2
                if self._t1.pop(key, None) is not None:  # unpinned: the plain driver's order
                    self._clock += 1
                    self._t2[key] = self._clock
            elif key in self._t2:
                self._clock += 1
                self._t2[key] = self._clock
                self._t2.move_to_end(key)
            return True
        freq.access(key)
        if count is None:
            return False
        self._reused.add(key)
        return True

    def _end_window(self) -> None:
        scores, hits = self._scores, self._window_hits
        for index in range(3):
            scores[index] = scores[index] * SCORE_DECAY + hits[index]
            hits[index] = 0
        self._window_count = 0
        expert = max(range(3), key=lambda index: (scores[index], -index))
        if expert == _LFU and self._expert != _LFU:
            self._order_by_counts()
        elif expert != _LFU and self._expert == _LFU:
            self._rebuild_lists()
        self._expert = expert

    def _order_by_counts(self) -> None:
        """LFU takes the lead: order the unpinned keys by count and set ARC's lists aside."""
        self._freq.start_order(self._released())
        self._reused = {key for key, list_ in self._where.items() if list_ == T2}
        for structure in (self._where, self._t1, self._t2, self._b1, self._b2):
            structure.clear()
        self._t1_size = self._t2_size = 0
        self._pending_ghost = None

    def _rebuild_lists(self) -> None:
        """LFU loses the lead: ARC's lists, ghosts and target rebuilt (module docstring)."""
        freq, where, capacity = self._freq, self._where, self.capacity
        reused = self._reused
        for key in freq.released():
            self._clock += 1
            if key in reused:
                where[key], self._t2[key] = T2, self._clock
            else:
                where[key], self._t1[key] = T1, self._clock
        for key in self._pinned:
            where[key] = T2 if key in reused else T1
        reused.clear()
        # ARC's target as the miniature ARC learned it meanwhile, scaled to this cache.
        mini = self._minis[_ARC]
        self._p = min(float(capacity), mini.target * capacity / mini.capacity)
        self._t1_size = sum(1 for list_ in where.values() if list_ == T1)
        self._t2_size = len(where) - self._t1_size
        # Ghosts newest first until a bound of ARC's case IV would break, then oldest first.
        ghosts: list[tuple[Key, int]] = []
        t1_and_b1 = self._t1_size
        for key, count in freq.history_newest_first():
            if len(where) + len(ghosts) == 2 * capacity:
                break
            if count == 1:
                if t1_and_b1 == capacity:
                    continue
                t1_and_b1 += 1
            ghosts.append((key, B1 if count == 1 else B2))
        for key, list_ in reversed(ghosts):
            where[key] = list_
            (self._b1 if list_ == B1 else self._b2)[key] = None
        freq.stop_order()

    def insert(self, key: Key) -> None:
        if self._expert == _LFU:
            assert len(self._freq.counts) < self.capacity, f"insert of {key!r} into a full trio"
            self._pinned.add(key)
        else:
            ARC.insert(self, key)
        self._freq.add(key)
        if self._pending_sampled:
            self._sampled_resident.add(key)

    def to_evict(self) -> Key | None:
        expert = self._expert
        if expert == _LFU:
            return self._freq.first()
        if expert == _LRU:
            t1, t2 = self._t1, self._t2
            if not t1 or not t2:
                return next(iter(t1 or t2), None)
            first1, first2 = next(iter(t1)), next(iter(t2))
            return first1 if t1[first1] < t2[first2] else first2
        return ARC.to_evict(self)

    def evict(self, key: Key) -> None:
        self._freq.drop(key, remember=True)
        self._sampled_resident.discard(key)
        if self._expert != _LFU:
            ARC.evict(self, key)
            return
        # Counted under the list ARC would have held the key in.
        evictions, reused = self.counters.evictions, self._reused
        list_name = "t2" if key in reused else "t1"
        evictions[list_name] = evictions.get(list_name, 0) + 1
        reused.discard(key)

    def remove(self, key: Key) -> None:
        if key not in self._freq or key in self._pinned:
            raise KeyError(key)
        if self._expert != _LFU:
            ARC.remove(self, key)
        self._reused.discard(key)
        self._sampled_resident.discard(key)
        self._freq.drop(key, remember=False)

    # ARC's pin and unpin inline: a call less for every block a request takes and frees.
    def pin(self, key: Key) -> None:
        if self._expert == _LFU:
            self._freq.hold(key)
        elif self._where[key] == T1:
            del self._t1[key]
        else:
            del self._t2[key]
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.remove(key)
        if self._expert == _LFU:
            self._freq.release(key)
            return
        self._clock += 1
        (self._t1 if self._where[key] == T1 else self._t2)[key] = self._clock

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def resident_keys(self) -> Iterator[Key]:
        if self._expert != _LFU:
            yield from ARC.resident_keys(self)
            return
        yield from self._freq.released()
        yield from self._pinned

    def list_sizes(self) -> dict[str, int]:
        if self._expert != _LFU:
            return ARC.list_sizes(self)
        # The lists ARC would hold the keys in; its ghosts are set aside.
        reused = len(self._reused)
        return {"t1": len(self._freq) - reused, "t2": reused, "b1": 0, "b2": 0}

    def clear(self) -> None:
        super().clear()
        self._freq.clear()
        self._freq.stop_order()
        for mini in self._minis:
            mini.clear()
        self._scores = [0.0, 0.0, 0.0]
        self._window_hits = [0, 0, 0]
        self._window_count = 0
        self._expert = _ARC
        self._reused.clear()
        self._sampled_resident.clear()

    def verify(self) -> None:
        assert self._freq.ordered == (self._expert == _LFU), "Trio LFU order out of step"
        if self._expert == _LFU:
            assert not (self._where or self._t1 or self._t2 or self._b1 or self._b2), (
                "ARC's lists are not empty while LFU leads"
            )
            assert self._t1_size == self._t2_size == 0, "ARC's list sizes kept while LFU leads"
            assert 0.0 <= self._p <= self.capacity, f"p = {self._p} outside [0, {self.capacity}]"
            resident = self._freq.resident()
            assert self._reused <= resident, "a key counted as hit since it entered is not resident"
            self._freq.verify(resident - self._pinned, self._pinned)
        else:
            super().verify()
            assert not self._reused, "Trio keeps LFU's T2 set while ARC's lists are up"
            self._freq.verify({*self._t1, *self._t2}, self._pinned)
        assert len(self._freq) <= self.capacity, "Trio holds more than its capacity"
        for mini in self._minis:
            mini.verify()
            assert all(self._sampled(key) for key in mini.resident_keys()), (
                "a miniature cache holds a key outside the sample"
            )
        assert 0 <= self._window_count < self.window, "Trio window count out of range"
        assert self._sampled_resident == {k for k in self._freq.counts if self._sampled(k)}, (
            "Trio's resident sample differs from the sampled resident keys"
        )
