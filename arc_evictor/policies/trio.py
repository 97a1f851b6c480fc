"""Trio: ARC whose victim follows whichever of ARC, LRU and LFU its miniatures show ahead.

Why: no single order wins every workload a prefix cache sees. On document QA
(a Zipf law over long shared documents) the blocks worth keeping are the popular
documents', which only frequency with memory finds (LFU closes a third of the gap
to Belady there); on multi-turn chat recency wins (LRU or ARC); on the Mooncake
sample ARC does. An earlier candidate that chose between ARC and LRU only never closed any
of the gap to Belady; Trio adds LFU.

Variant: the real cache is ARC exactly (arc.py: lists, ghosts, target ``p``), plus
access counts (``lfu.FrequencyOrder``: capped at 255, kept for ``history_factor *
capacity`` evicted keys). LRU's victim is the older of T1's and T2's least recently
released blocks (both lists are ordered by release stamp); LFU's (count, release)
order is built when LFU takes the lead and dropped when it loses it. Three miniature caches
(Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations",
USENIX ATC'17) replay a hash-sampled share of the keys, one ARC, one LRU and one
LFU, each with the sampled share of the capacity; the share is the largest power of
two that leaves each miniature at least ``MIN_MINIATURE_BLOCKS`` blocks (smaller
miniatures misjudge prefix traffic). Every ``window`` sampled accesses (half a
miniature) each expert's score decays by ``SCORE_DECAY`` and gains its hits in that
window; the expert with the highest score (ties: ARC, then LRU, then LFU) names the
victims until the next window ends. The slow decay (a memory of about 20 windows)
matters: with scores halved each window, experts within a point of each other took
turns, and every turn cost hits (up to 0.8 points below max(LRU, ARC)). Whoever
names it, the victim goes to B1 or B2 as in ARC, so ARC's learning goes on while
another expert leads.

Prefix caches: all three orders evict a block's descendants before the block
(LRU and ARC by release order, LFU because a parent's count is at least its
child's, ties by release order).

Cost: O(1) per operation, amortised: ARC's work, one count per ``find``, one
multiplicative hash per ``find``, a sampled share of the work in three miniature
caches (under 2,048 / c of the keys: every key below 2,048 blocks, 1/8 at 13,072), and
while LFU leads one bucket update per pin and unpin. Building the LFU order costs O(c)
and happens at most once a window, and a window is about ``c / 2`` accesses.

Name map: ``_freq`` the counts and frequency order; ``_minis`` the
miniatures (ARC, LRU, LFU); ``_scores`` their decayed hit counts; ``_expert`` the
index of the expert that names victims.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from arc_evictor.policies.arc import ARC, T1, T2
from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.lfu import LFU, FrequencyOrder
from arc_evictor.policies.lru import LRU

# Fibonacci hashing: spreads interned (consecutive) integer keys over the sample space.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _stable_hash(key: Key) -> int:
    """The same number for the same key in every process and replica.

    ``hash`` of bytes and str changes with PYTHONHASHSEED, and the vLLM plugin's keys are
    bytes, so sampling by ``hash`` would pick other keys after every restart.
    """
    if isinstance(key, bytes):
        return int.from_bytes(key[:8], "big")
    return hash(key)


# Each miniature holds at least this many blocks (caches below twice this sample every key).
MIN_MINIATURE_BLOCKS = 1024
# Per window, each expert's score is multiplied by this before its window hits are added.
SCORE_DECAY = 0.95
EXPERTS = ("arc", "lru", "lfu")
_ARC, _LRU, _LFU = 0, 1, 2


def _mini_access(policy: EvictionPolicy, key: Key) -> bool:
    """One access of ``key`` in a miniature cache that never holds pins: True on a hit.

    The calls are the plain driver's (``find`` before ``pin``; every policy's ``find``
    accepts an unpinned resident key): a miniature has no pool to pin first.
    """
    hit = policy.find(key)
    if hit:
        policy.pin(key)
    else:
        if len(policy) == policy.capacity:  # it holds no pins: one victim makes room
            policy.evict(policy.to_evict())
        policy.insert(key)
    policy.unpin(key)
    return hit


class Trio(ARC):
    """ARC's lists; victims from the ARC, LRU or LFU order, whichever miniature leads.

    Invariants (on top of ARC's, all checked by ``verify``):
    - ``_freq`` counts every resident key, and orders exactly the unpinned resident
      keys exactly while the expert is LFU;
    - the miniatures hold only sampled keys and are valid policies themselves;
    - ``0 <= _window_count < window``; ``_expert`` is the best score as of the last
      window's end (ARC before the first).
    """

    name = "trio"

    def __init__(
        self,
        capacity: int,
        *,
        min_miniature_blocks: int = MIN_MINIATURE_BLOCKS,
        history_factor: int = 4,
    ) -> None:
        super().__init__(capacity)
        if min_miniature_blocks < 1:
            raise PolicyError(f"trio min_miniature_blocks must be >= 1, got {min_miniature_blocks}")
        if history_factor < 0:
            raise PolicyError(f"trio history_factor must be >= 0, got {history_factor}")
        # The largest power-of-two share that leaves each miniature min_miniature_blocks.
        self._sample_bits = min(16, max(0, (capacity // min_miniature_blocks).bit_length() - 1))
        self._sample_shift = 64 - self._sample_bits
        mini_capacity = max(1, capacity >> self._sample_bits)
        self._minis: tuple[EvictionPolicy, ...] = (
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

    def describe(self) -> str:
        return f"trio-1/{1 << self._sample_bits}"

    @property
    def expert(self) -> str:
        """The expert whose order names victims now: ``arc``, ``lru`` or ``lfu``."""
        return EXPERTS[self._expert]

    def _sampled(self, key: Key) -> bool:
        # The top sample_bits bits of the hash are zero (a shift of 64 keeps every key).
        return ((_stable_hash(key) * _GOLDEN) & _MASK64) >> self._sample_shift == 0

    def find(self, key: Key) -> bool:
        if self._sampled(key):
            hits = self._window_hits
            for index, mini in enumerate(self._minis):
                hits[index] += _mini_access(mini, key)
            self._window_count += 1
            if self._window_count == self.window:
                self._end_window()
        self._freq.access(key)
        return ARC.find(self, key)

    def _end_window(self) -> None:
        scores, hits = self._scores, self._window_hits
        for index in range(3):
            scores[index] = scores[index] * SCORE_DECAY + hits[index]
            hits[index] = 0
        self._window_count = 0
        expert = max(range(3), key=lambda index: (scores[index], -index))
        if expert != self._expert:
            if expert == _LFU:
                self._freq.start_order(self._released())
            elif self._expert == _LFU:
                self._freq.stop_order()
            self._expert = expert

    def _released(self) -> Iterator[Key]:
        """Unpinned resident keys, least recently released first."""
        by_release = heapq.merge(self._t1.items(), self._t2.items(), key=lambda item: item[1])
        for key, _stamp in by_release:
            yield key

    def insert(self, key: Key) -> None:
        ARC.insert(self, key)
        self._freq.add(key)

    def to_evict(self) -> Key | None:
        expert = self._expert
        if expert == _LRU:
            t1, t2 = self._t1, self._t2
            if not t1 or not t2:
                return next(iter(t1 or t2), None)
            first1, first2 = next(iter(t1)), next(iter(t2))
            return first1 if t1[first1] < t2[first2] else first2
        if expert == _LFU:
            return self._freq.first()
        return ARC.to_evict(self)

    def evict(self, key: Key) -> None:
        self._freq.drop(key, remember=True)
        ARC.evict(self, key)

    def remove(self, key: Key) -> None:
        if self._where.get(key) not in (T1, T2) or key in self._pinned:
            raise KeyError(key)
        ARC.remove(self, key)
        self._freq.drop(key, remember=False)

    def pin(self, key: Key) -> None:
        ARC.pin(self, key)
        if self._expert == _LFU:
            self._freq.hold(key)

    def unpin(self, key: Key) -> None:
        ARC.unpin(self, key)
        if self._expert == _LFU:
            self._freq.release(key)

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

    def verify(self) -> None:
        super().verify()
        assert self._freq.ordered == (self._expert == _LFU), "Trio LFU order out of step"
        self._freq.verify({*self._t1, *self._t2}, self._pinned)
        for mini in self._minis:
            mini.verify()
            assert all(self._sampled(key) for key in mini.resident_keys()), (
                "a miniature cache holds a key outside the sample"
            )
        assert 0 <= self._window_count < self.window, "Trio window count out of range"
