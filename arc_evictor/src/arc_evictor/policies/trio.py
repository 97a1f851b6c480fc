"""``trio``: evict in the order of whichever of ARC, LRU and LFU its
miniature caches show ahead lately.

Algorithm. Three experts each propose an eviction order: ARC (arc.py), LRU (least
recently released first) and LFU with remembered counts (lfu.py). A judge replays a
hash-sampled share of the keys through one miniature cache per expert, each with the
sampled share of the capacity (Waldspurger et al., "Cache Modeling and Optimization
using Miniature Simulations", USENIX ATC'17). Every ``window`` sampled accesses each
expert's score decays by ``SCORE_DECAY`` and gains its miniature's hits in that window,
and the real cache follows the expert with the highest score (ties: ARC, then LRU, then
LFU) until the next window ends: "follow the leader" from prediction with expert advice,
with discounted scores.

Why three: no single order wins every workload a prefix cache sees. On document QA (a
Zipf law over long shared documents) the blocks worth keeping are the popular
documents', which only frequency with memory finds; on multi-turn chat recency wins
(LRU or ARC); on the Mooncake sample ARC does.

Parameters. The sampled share is the largest power of two that leaves each miniature at
least ``MIN_MINIATURE_BLOCKS`` blocks (smaller miniatures misjudge prefix traffic). A
window is half a miniature; the slow decay (a memory of about 20 windows) keeps experts
within a point of each other from taking turns, and every change of lead costs hits.

The real cache, by leader:
- ARC: an ``ARC`` holds the resident keys and chooses the victims.
- LRU: the same ``ARC`` names the older of T1's and T2's least recently released keys
  (both lists are ordered by release); the victim still goes to B1 or B2, so ARC's
  learning goes on while LRU leads.
- LFU: ``lfu.FrequencyOrder`` orders the unpinned resident keys by (count, release),
  and a set holds the keys ARC would hold in T2 (hit since they entered). The ``ARC`` is
  empty but keeps its target ``p``: keeping its lists up to date as well would cost
  about 0.4 of ARC's own time.
- Always: every resident key's access count (capped at ``MAX_COUNT``) and the counts of
  the last ``history_factor * capacity`` evicted keys, so LFU leads with warm counts.

A change of lead to LFU orders the unpinned keys by count and empties the ``ARC``. A
change away from LFU reloads the ``ARC``: T1 and T2 from the keys in release order,
split by the T2 set; ghosts from the remembered counts, most recently evicted first
while ARC's bounds allow (used once: B1, else B2); ``p`` from the miniature ARC's,
scaled to the real capacity (the ``p`` kept from before LFU led is stale by then).

Prefix caches: all three orders evict a block's descendants before the block (LRU and
ARC by release order, LFU because a parent's count is at least its child's, ties by
release order).

Cost: O(1) per operation, amortised: the leading order's work (ARC's or LFU's), one
count per ``find``, one multiplicative hash per missed ``find`` (a hit asks the set of
sampled resident keys instead), and the three miniatures' work for a sampled share of
the keys (every key below 2,048 blocks, 1/8 at 13,072). A change of lead between LFU
and the others costs O(c): it builds one order (merging ARC's two lists, or at most
``MAX_COUNT`` count buckets) and, when ARC comes back, reads at most
``history_factor * c`` remembered counts. It happens at most once a window.

Name map: experts ``EXPERTS`` (indices ``_ARC``, ``_LRU``, ``_LFU``); the judge
``MiniatureJudge`` (miniatures, scores, window); the real cache's ``_arc`` (T1, T2, B1,
B2 and p as in arc.py), ``_counts`` (counts, history and LFU's order), ``_t2_keys`` and
``_pinned`` (the keys ARC would hold in T2, and the pinned keys, while LFU leads).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from arc_evictor.policies.arc import ARC
from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.lfu import LFU, MAX_COUNT, FrequencyOrder
from arc_evictor.policies.lru import LRU
from arc_evictor.policies.statistics import ReportsStatistics

# Fibonacci hashing: spreads interned (consecutive) integer keys over the sample space.
_GOLDEN: Final = 0x9E3779B97F4A7C15
_MASK64: Final = (1 << 64) - 1
# Each miniature holds at least this many blocks (caches below twice this sample every key).
MIN_MINIATURE_BLOCKS: Final = 1024
# Per window, each expert's score is multiplied by this before its window hits are added.
SCORE_DECAY: Final = 0.95
EXPERTS: Final = ("arc", "lru", "lfu")
_ARC: Final = 0
_LRU: Final = 1
_LFU: Final = 2


def _stable_hash(key: Key) -> int:
    """The same number for the same key in every process and replica.

    ``hash`` of bytes and str changes with PYTHONHASHSEED, and the vLLM plugin's keys are
    bytes, so sampling by ``hash`` would pick other keys after every restart.
    """
    return int.from_bytes(key[:8], "big") if key.__class__ is bytes else hash(key)


def _expert_index(expert: str) -> int:
    try:
        return EXPERTS.index(expert)
    except ValueError:
        raise PolicyError(f"unknown expert {expert!r}; experts: {', '.join(EXPERTS)}") from None


class MiniatureJudge:
    """Scores the experts by one miniature cache each on a hash-sampled share of the keys.

    Invariants (checked by ``verify``):
    - every miniature holds only sampled keys and is a valid policy itself;
    - ``0 <= _window_count < window``;
    - ``_leader`` has the highest score as of the last window's end (ARC before the first).
    """

    def __init__(self, capacity: int, *, min_miniature_blocks: int, history_factor: int) -> None:
        if min_miniature_blocks < 1:
            raise PolicyError(f"trio min_miniature_blocks must be >= 1, got {min_miniature_blocks}")
        # The largest power-of-two share that leaves each miniature min_miniature_blocks.
        self.sample_bits = min(16, max(0, (capacity // min_miniature_blocks).bit_length() - 1))
        # A key is sampled when its scrambled hash is below this (all keys: 2**64).
        self.sample_limit = 1 << (64 - self.sample_bits)
        mini_capacity = max(1, capacity >> self.sample_bits)
        self._miniatures = (
            ARC(mini_capacity),
            LRU(mini_capacity),
            LFU(mini_capacity, history_factor=history_factor),
        )
        # Half a miniature cache-full: the slow score decay, not the window, smooths the choice.
        self.window = max(64, mini_capacity // 2)
        self._scores = [0.0, 0.0, 0.0]
        # Floats: ``credit`` may add a fraction of a hit.
        self._window_hits = [0.0, 0.0, 0.0]
        self._window_count = 0
        self._leader = _ARC

    @property
    def leader(self) -> str:
        """The expert with the highest score at the last window's end."""
        return EXPERTS[self._leader]

    @property
    def scores(self) -> dict[str, float]:
        """Each expert's decayed hit count as of the last window's end (a copy)."""
        return dict(zip(EXPERTS, self._scores, strict=True))

    @property
    def window_count(self) -> int:
        """Sampled accesses so far in the current window."""
        return self._window_count

    def miniature(self, expert: str) -> ARC | LRU | LFU:
        """The miniature cache that scores ``expert``."""
        return self._miniatures[_expert_index(expert)]

    @property
    def arc_miniature(self) -> ARC:
        """The ARC expert's miniature (its target ``p`` seeds the real ARC's)."""
        arc, _lru, _lfu = self._miniatures
        return arc

    def sampled(self, key: Key) -> bool:
        """Whether the miniatures see ``key`` (the same answer in every process)."""
        return (_stable_hash(key) * _GOLDEN) & _MASK64 < self.sample_limit

    def observe(self, key: Key) -> bool:
        """A sampled ``key`` is accessed: one access in every miniature. True when this
        access ended a window (the leader may have changed)."""
        arc, lru, lfu = self._miniatures
        hits = self._window_hits
        hits[_ARC] += arc.access(key)
        hits[_LRU] += lru.access(key)
        hits[_LFU] += lfu.access(key)
        self._window_count += 1
        if self._window_count < self.window:
            return False
        self.end_window()
        return True

    def credit(self, expert: str, hits: float) -> None:
        """Add ``hits`` to ``expert``'s hits in the current window, as its miniature would."""
        self._window_hits[_expert_index(expert)] += hits

    def end_window(self) -> None:
        """Decay every score, add the window's hits, and choose the leader."""
        scores, hits = self._scores, self._window_hits
        for index in range(len(EXPERTS)):
            scores[index] = scores[index] * SCORE_DECAY + hits[index]
            hits[index] = 0.0
        self._window_count = 0
        self._leader = max(range(len(EXPERTS)), key=lambda index: (scores[index], -index))

    def clear(self) -> None:
        for miniature in self._miniatures:
            miniature.clear()
        self._scores = [0.0, 0.0, 0.0]
        self._window_hits = [0.0, 0.0, 0.0]
        self._window_count = 0
        self._leader = _ARC

    def verify(self) -> None:
        for miniature in self._miniatures:
            miniature.verify()
            assert all(self.sampled(key) for key in miniature.resident_keys()), (
                "a miniature cache holds a key outside the sample"
            )
        assert 0 <= self._window_count < self.window, "trio window count out of range"


class Trio(EvictionPolicy, ReportsStatistics):
    """The real cache in the order of the expert its judge finds ahead (module docstring).

    Invariants (all checked by ``verify``):
    - ``_counts`` counts exactly the resident keys; ``_sampled_resident`` holds exactly
      the resident keys in the judge's sample;
    - while ARC or LRU leads: ``_arc`` holds exactly the resident keys (with ARC's own
      invariants), ``_counts`` keeps no order, and ``_t2_keys`` and ``_pinned`` are empty;
    - while LFU leads: ``_counts`` orders exactly the unpinned resident keys, ``_pinned``
      holds the pinned ones, ``_t2_keys`` holds only resident keys, and ``_arc`` holds no
      key (only its target ``p``, in [0, c]);
    - ``counters`` is ``_arc``'s: ARC's evictions and ghost hits, and LFU's evictions
      under the list ARC would have held the victim in.

    The methods dispatch on the leader at each call, never by rebinding: block pools keep
    ``policy.pin`` and ``policy.find`` in locals across calls that may change the leader.
    """

    name = "trio"
    resident_lists = ARC.resident_lists
    ghost_lists = ARC.ghost_lists

    def __init__(
        self,
        capacity: int,
        *,
        min_miniature_blocks: int = MIN_MINIATURE_BLOCKS,
        history_factor: int = 6,
    ) -> None:
        super().__init__(capacity)
        if history_factor < 0:
            raise PolicyError(f"trio history_factor must be >= 0, got {history_factor}")
        self.judge = MiniatureJudge(
            capacity, min_miniature_blocks=min_miniature_blocks, history_factor=history_factor
        )
        self._arc = ARC(capacity)
        self.counters = self._arc.counters
        self._counts = FrequencyOrder(history_factor * capacity, ordered=False)
        self._leader = _ARC
        self._t2_keys: set[Key] = set()
        self._pinned: set[Key] = set()
        # A hit asks this set instead of hashing the key (most accesses are hits).
        self._sampled_resident: set[Key] = set()
        # Whether the key that missed in the last ``find`` is in the sample.
        self._pending_sampled = False

    @property
    def leader(self) -> str:
        """The expert whose order the real cache follows: ``arc``, ``lru`` or ``lfu``."""
        return EXPERTS[self._leader]

    @property
    def target(self) -> float:
        """ARC's target ``p`` (kept, not adapted, while LFU leads)."""
        return self._arc.target

    def describe(self) -> str:
        return f"trio-1/{1 << self.judge.sample_bits}"

    def count(self, key: Key) -> int:
        """The access count remembered for ``key`` (resident or evicted), else 0."""
        return self._counts.count(key)

    def list_of(self, key: Key) -> str | None:
        """The ARC list that holds ``key``; while LFU leads, the one ARC would hold a
        resident key in (``t1`` or ``t2``; no ghosts)."""
        if self._leader != _LFU:
            return self._arc.list_of(key)
        if key not in self._counts:
            return None
        return "t2" if key in self._t2_keys else "t1"

    def follow(self, expert: str) -> None:
        """Evict in ``expert``'s order from now on (``find`` calls this at a window's end)."""
        leader = _expert_index(expert)
        if leader == _LFU and self._leader != _LFU:
            self._order_by_counts()
        elif leader != _LFU and self._leader == _LFU:
            self._reload_arc()
        self._leader = leader

    def _order_by_counts(self) -> None:
        """LFU takes the lead: the counts order the unpinned keys, and the ARC empties."""
        arc, counts = self._arc, self._counts
        released = list(arc.released())
        counts.start_order(released)
        self._t2_keys = {key for key in counts.counts if arc.list_of(key) == "t2"}
        self._pinned = counts.resident().difference(released)
        arc.reload((), (), (), arc.target)

    def _reload_arc(self) -> None:
        """LFU loses the lead: the ARC takes the keys back (module docstring)."""
        counts, t2_keys, capacity = self._counts, self._t2_keys, self.capacity
        mini = self.judge.arc_miniature
        self._arc.reload(
            ((key, key in t2_keys) for key in counts.released()),
            ((key, key in t2_keys) for key in self._pinned),
            ((key, count > 1) for key, count in counts.history_newest_first()),
            min(float(capacity), mini.target * capacity / mini.capacity),
        )
        counts.stop_order()
        t2_keys.clear()
        self._pinned.clear()

    def find(self, key: Key) -> bool:
        counts = self._counts.counts
        count = counts.get(key)
        if count is None:
            # The judge's ``sampled`` inline: this runs for every missed block.
            hashed = int.from_bytes(key[:8], "big") if key.__class__ is bytes else hash(key)
            sampled = (hashed * _GOLDEN) & _MASK64 < self.judge.sample_limit
            self._pending_sampled = sampled
        else:
            sampled = key in self._sampled_resident
        if sampled and self.judge.observe(key):
            self.follow(self.judge.leader)
        if self._leader != _LFU:
            if count is None:
                self._counts.access(key)  # the count comes back from the history
            elif count < MAX_COUNT:
                counts[key] = count + 1  # FrequencyOrder.access, with no order to keep
            return self._arc.find(key)  # a ghost hit moves p
        self._counts.access(key)
        if count is None:
            return False
        self._t2_keys.add(key)
        return True

    def insert(self, key: Key) -> None:
        if self._leader == _LFU:
            assert len(self._counts.counts) < self.capacity, f"insert of {key!r} into a full trio"
            self._pinned.add(key)
        else:
            self._arc.insert(key)
        self._counts.add(key)
        if self._pending_sampled:
            self._sampled_resident.add(key)

    def to_evict(self) -> Key | None:
        leader = self._leader
        if leader == _LFU:
            return self._counts.first()
        if leader == _LRU:
            return self._arc.least_recently_released()
        return self._arc.to_evict()

    def evict(self, key: Key) -> None:
        self._counts.drop(key, remember=True)
        self._sampled_resident.discard(key)
        if self._leader != _LFU:
            self._arc.evict(key)
            return
        # Counted inline (the hot path), under the list ARC would have held the key in.
        evictions, t2_keys = self.counters.evictions, self._t2_keys
        list_name = "t2" if key in t2_keys else "t1"
        evictions[list_name] = evictions.get(list_name, 0) + 1
        t2_keys.discard(key)

    def remove(self, key: Key) -> None:
        if self._leader != _LFU:
            self._arc.remove(key)  # KeyError, changing nothing, unless resident and unpinned
        elif key not in self._counts or key in self._pinned:
            raise KeyError(key)
        self._t2_keys.discard(key)
        self._sampled_resident.discard(key)
        self._counts.drop(key, remember=False)

    def pin(self, key: Key) -> None:
        if self._leader == _LFU:
            self._counts.hold(key)
            self._pinned.add(key)
        else:
            self._arc.pin(key)

    def unpin(self, key: Key) -> None:
        if self._leader == _LFU:
            self._pinned.remove(key)
            self._counts.release(key)
        else:
            self._arc.unpin(key)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def resident_keys(self) -> Iterator[Key]:
        if self._leader != _LFU:
            yield from self._arc.resident_keys()
            return
        yield from self._counts.released()
        yield from self._pinned

    def list_sizes(self) -> dict[str, int]:
        if self._leader != _LFU:
            return self._arc.list_sizes()
        t2 = len(self._t2_keys)
        return {"t1": len(self._counts) - t2, "t2": t2, "b1": 0, "b2": 0}

    def clear(self) -> None:
        self._arc.clear()
        self._counts.clear()
        self._counts.stop_order()
        self.judge.clear()
        self._leader = _ARC
        self._t2_keys.clear()
        self._pinned.clear()
        self._sampled_resident.clear()

    def verify(self) -> None:
        arc, counts = self._arc, self._counts
        resident = counts.resident()
        arc.verify()
        assert counts.ordered == (self._leader == _LFU), "trio's LFU order out of step"
        if self._leader == _LFU:
            assert not any(arc.list_sizes().values()), "ARC holds keys while LFU leads"
            assert self._t2_keys <= resident, "a key counted as hit since it entered is gone"
            counts.verify(resident - self._pinned, self._pinned)
        else:
            assert not (self._t2_keys or self._pinned), "LFU's sets kept while ARC leads"
            released = set(arc.released())
            counts.verify(released, set(arc.resident_keys()) - released)
        assert len(counts) <= self.capacity, "trio holds more than its capacity"
        self.judge.verify()
        assert self._sampled_resident == {key for key in resident if self.judge.sampled(key)}, (
            "trio's resident sample differs from the sampled resident keys"
        )
