"""GARC: ARC guarded by miniature simulations of ARC and LRU.

Why: plain ARC loses a few points of hit rate to LRU on conversation traffic
when the cache is large (its ghost-driven split keeps frequency blocks that no
longer pay off), while it wins at small caches and on document QA. GARC keeps
ARC's lists and follows whichever of ARC and LRU is doing better right now.

Variant: the real cache is ARC exactly (arc.py: lists, ghosts, target ``p``),
plus one extra order, every unpinned resident block by release time (the order
LRU evicts in). Two miniature caches (Waldspurger et al., "Cache Modeling and
Optimization using Miniature Simulations", USENIX ATC'17) replay a hash-sampled
share of the keys, one ARC and one LRU, each with the sampled share of the
capacity. Every ``window`` sampled accesses the difference of their hits in that
window is added to a score that halves each window; while the score is negative
(LRU's miniature has been hitting more), the victim is the least recently
released block, else ARC's REPLACE picks it. Either way the victim goes to B1 or
B2 as in ARC, so ARC's learning goes on while LRU leads.

Prefix caches: LRU's order never evicts a block before its descendants (a request
releases its blocks tail first, so a parent is always released after its child);
the miniatures count per-block hits, which is what both policies optimise.

Cost: ARC's O(1) per operation, plus one multiplicative hash per ``find`` and a
sampled share (1/8 by default; all keys for caches of at most 1,024 blocks, where
a sample would be too small to compare) of the work in two miniature caches.

Name map: ``_lru`` the release order; ``_mini_arc``/``_mini_lru`` the miniatures;
``_score`` the decayed hit difference (ARC minus LRU); ``_follow_lru`` the mode.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from arc_evictor.policies.arc import ARC, T1, T2
from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.lru import LRU

# Fibonacci hashing: spreads interned (consecutive) integer keys over the sample space.
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Caches up to this many blocks feed every key to the miniatures.
_FULL_SAMPLE_BLOCKS = 1024


def _mini_access(policy: EvictionPolicy, key: Key) -> bool:
    """One access of ``key`` in a miniature cache that never holds pins: True on a hit."""
    if key in policy:
        policy.pin(key)
        policy.find(key)
        policy.unpin(key)
        return True
    policy.find(key)
    while len(policy) >= policy.capacity:
        policy.evict(policy.to_evict())
    policy.insert(key)
    policy.unpin(key)
    return False


class GARC(ARC):
    """ARC whose victim follows LRU's order while LRU's miniature is ahead.

    Invariants (on top of ARC's, all checked by ``verify``):
    - ``_lru`` holds exactly the unpinned resident keys (T1's and T2's orders
      merged), least recently released first;
    - the miniatures hold only sampled keys and are valid policies themselves;
    - ``0 <= _window_count < window``; ``_follow_lru`` is ``_score < 0`` as of the
      last window's end.
    """

    name = "garc"

    def __init__(self, capacity: int, *, sample_bits: int = 3) -> None:
        super().__init__(capacity)
        if not 0 <= sample_bits <= 16:
            raise PolicyError(f"garc sample_bits must be in [0, 16], got {sample_bits}")
        self._sample_bits = 0 if capacity <= _FULL_SAMPLE_BLOCKS else sample_bits
        mini_capacity = max(1, capacity >> self._sample_bits)
        self._mini_arc = ARC(mini_capacity)
        self._mini_lru = LRU(mini_capacity)
        # A window of a few miniature cache-fulls: long enough to compare, short enough to react.
        self.window = max(64, 2 * mini_capacity)
        self._lru: OrderedDict[Key, None] = OrderedDict()
        self._score = 0.0
        self._window_diff = 0
        self._window_count = 0
        self._follow_lru = False

    def describe(self) -> str:
        return f"garc-1/{1 << self._sample_bits}"

    @property
    def follows_lru(self) -> bool:
        """True while victims follow LRU's order (LRU's miniature is ahead)."""
        return self._follow_lru

    def _sampled(self, key: Key) -> bool:
        bits = self._sample_bits
        return not bits or ((hash(key) * _GOLDEN) & _MASK64) >> (64 - bits) == 0

    def find(self, key: Key) -> bool:
        if self._sampled(key):
            self._window_diff += _mini_access(self._mini_arc, key) - _mini_access(
                self._mini_lru, key
            )
            self._window_count += 1
            if self._window_count == self.window:
                self._score = self._score / 2 + self._window_diff
                self._follow_lru = self._score < 0
                self._window_diff = self._window_count = 0
        return super().find(key)

    def to_evict(self) -> Key | None:
        if self._follow_lru:
            return next(iter(self._lru), None)
        return super().to_evict()

    def evict(self, key: Key) -> None:
        del self._lru[key]
        super().evict(key)

    def remove(self, key: Key) -> None:
        if self._where.get(key) not in (T1, T2) or key in self._pinned:
            raise KeyError(key)
        super().remove(key)
        del self._lru[key]

    def pin(self, key: Key) -> None:
        super().pin(key)
        del self._lru[key]

    def unpin(self, key: Key) -> None:
        super().unpin(key)
        self._lru[key] = None

    def resident_keys(self) -> Iterator[Key]:
        yield from self._lru
        yield from self._pinned

    def clear(self) -> None:
        super().clear()
        self._lru.clear()
        self._mini_arc.clear()
        self._mini_lru.clear()
        self._score = 0.0
        self._window_diff = self._window_count = 0
        self._follow_lru = False

    def verify(self) -> None:
        super().verify()
        merged = sorted([*self._t1.items(), *self._t2.items()], key=lambda item: item[1])
        assert list(self._lru) == [key for key, _stamp in merged], (
            "GARC release order differs from T1 and T2 merged by release stamp"
        )
        for mini in (self._mini_arc, self._mini_lru):
            mini.verify()
            assert all(self._sampled(key) for key in mini.resident_keys()), (
                "a miniature cache holds a key outside the sample"
            )
        assert 0 <= self._window_count < self.window, "GARC window count out of range"
