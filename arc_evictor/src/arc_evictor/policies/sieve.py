"""SIEVE: a FIFO queue with one visited bit and a moving hand.

Paper: Zhang, Yang, Yue, Vigfusson, Rashmi, "SIEVE is Simpler than LRU: an
Efficient Turn-Key Eviction Algorithm for Web Caches", NSDI'24.

Variant: libCacheSim's ``Sieve.c``. A new block enters at the head (newest end)
with its visited bit clear; a hit sets the bit and moves nothing. To evict, the
hand walks from where it stopped towards the head, clearing visited bits, and
evicts the first block whose bit is clear; the hand then rests on the next newer
block (past the head it wraps to the tail, the oldest block).

Adaptation to a block pool with pinning: a pinned block keeps its place and its
bit; the hand passes it without clearing the bit. ``to_evict`` walks a copy of
the hand and changes nothing; ``evict`` repeats the walk and clears bits.
Cost: O(1) amortised per operation (every bit the hand clears was set by a hit)
plus the pinned blocks the hand passes, at most the running batch's blocks per
lap.

Name map (libCacheSim -> here): ``q_tail`` (oldest) ``_root.newer``, ``q_head``
(newest) ``_root.older``, ``queue.prev`` (towards the head) ``_Node.newer``,
``pointer`` ``_hand`` (None = start at the tail), ``sieve.freq`` ``_Node.visited``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics


@dataclass(slots=True, eq=False)
class _Node:
    """One resident block in the circular queue (``_root`` is the sentinel)."""

    key: Key
    visited: bool = False
    pinned: bool = False
    newer: _Node = field(init=False, repr=False)
    older: _Node = field(init=False, repr=False)


class Sieve(EvictionPolicy, ReportsStatistics):
    """SIEVE over a block pool with pinned blocks.

    Invariants:
    - ``_nodes`` maps every resident key to its node, and the queue from
      ``_root.newer`` (oldest) to ``_root.older`` (newest) holds exactly those
      nodes, in insertion order;
    - ``_pinned_count`` is the number of nodes with ``pinned`` set;
    - ``_hand`` is None or a node in the queue;
    - ``len(_nodes) <= capacity``.
    """

    name = "sieve"
    resident_lists = ("sieve",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.counters = PolicyCounters()
        self._root = _Node(key=None)
        self._root.newer = self._root.older = self._root
        self._nodes: dict[Key, _Node] = {}
        self._hand: _Node | None = None
        self._pinned_count = 0

    def find(self, key: Key) -> bool:
        node = self._nodes.get(key)
        if node is None:
            return False
        node.visited = True
        return True

    def insert(self, key: Key) -> None:
        assert key not in self._nodes, f"insert of {key!r}, already resident in SIEVE"
        assert len(self._nodes) < self.capacity, f"insert of {key!r} into a full SIEVE"
        node = _Node(key=key, pinned=True)
        newest = self._root.older
        node.older, node.newer = newest, self._root
        newest.newer = self._root.older = node
        self._nodes[key] = node
        self._pinned_count += 1

    def _walk(self) -> Iterator[_Node]:
        """Nodes in hand order: from the hand towards the head, then from the tail round."""
        root = self._root
        start = self._hand if self._hand is not None else root.newer
        node = start
        for _ in range(len(self._nodes)):
            if node is root:
                node = root.newer
            yield node
            node = node.newer

    def _victim(self) -> _Node | None:
        # The first unpinned node with a clear bit; if every unpinned bit is set, the
        # hand clears them all in one lap and stops at the first unpinned node.
        first_unpinned: _Node | None = None
        for node in self._walk():
            if node.pinned:
                continue
            if not node.visited:
                return node
            if first_unpinned is None:
                first_unpinned = node
        return first_unpinned

    def to_evict(self) -> Key | None:
        if len(self._nodes) == self._pinned_count:
            return None
        victim = self._victim()
        return None if victim is None else victim.key

    def evict(self, key: Key) -> None:
        victim = self._victim()
        if victim is None or victim.key != key:
            expected = None if victim is None else victim.key
            raise PolicyError(f"SIEVE can evict only its next victim {expected!r}, not {key!r}")
        # A set victim bit means every unpinned bit is set: the hand clears them all in
        # one lap before it comes back to the victim.
        full_lap = victim.visited
        for node in self._walk():
            if node is victim and not full_lap:
                break
            if not node.pinned:
                node.visited = False
        newer = victim.newer
        self._hand = None if newer is self._root else newer
        self._unlink(victim)
        self.counters.count_eviction("sieve")

    def remove(self, key: Key) -> None:
        node = self._nodes[key]
        if node.pinned:
            raise PolicyError(f"cannot remove pinned block {key!r}")
        if node is self._hand:
            newer = node.newer
            self._hand = None if newer is self._root else newer
        self._unlink(node)

    def _unlink(self, node: _Node) -> None:
        node.older.newer = node.newer
        node.newer.older = node.older
        del self._nodes[node.key]

    def pin(self, key: Key) -> None:
        node = self._nodes[key]
        if node.pinned:
            raise PolicyError(f"pin of already pinned block {key!r}")
        node.pinned = True
        self._pinned_count += 1

    def unpin(self, key: Key) -> None:
        node = self._nodes[key]
        if not node.pinned:
            raise PolicyError(f"unpin of block {key!r}, which is not pinned")
        node.pinned = False
        self._pinned_count -= 1

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def resident_keys(self) -> Iterator[Key]:
        # Oldest first; pinned blocks are in use right now, so they come last.
        node = self._root.newer
        pinned = []
        while node is not self._root:
            if node.pinned:
                pinned.append(node.key)
            else:
                yield node.key
            node = node.newer
        yield from pinned

    def list_sizes(self) -> dict[str, int]:
        return {"sieve": len(self._nodes)}

    def clear(self) -> None:
        self._root.newer = self._root.older = self._root
        self._nodes.clear()
        self._hand = None
        self._pinned_count = 0

    def verify(self) -> None:
        seen = 0
        pinned = 0
        hand_found = self._hand is None
        node = self._root.newer
        while node is not self._root:
            assert node.newer.older is node, f"SIEVE links broken after {node.key!r}"
            assert self._nodes.get(node.key) is node, f"SIEVE queue node {node.key!r} not in map"
            seen += 1
            pinned += node.pinned
            hand_found = hand_found or node is self._hand
            node = node.newer
            assert seen <= len(self._nodes), "SIEVE queue longer than its key map"
        assert seen == len(self._nodes), f"SIEVE queue holds {seen}, map {len(self._nodes)}"
        assert pinned == self._pinned_count, f"SIEVE pinned {pinned} != {self._pinned_count}"
        assert hand_found, "SIEVE hand points at a node outside the queue"
        assert len(self._nodes) <= self.capacity, "SIEVE holds more than capacity"
