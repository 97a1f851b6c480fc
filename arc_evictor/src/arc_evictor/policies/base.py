"""The one interface every eviction policy implements.

A policy orders the resident blocks of a block pool; the pool owns residency,
reference counts (pins) and the number of free blocks. The split follows
libCacheSim's hooks (``find``, ``insert``, ``to_evict``, ``evict``, ``remove``)
plus two pool events, ``pin`` and ``unpin``, because a KV block that a running
request uses must never be evicted.

Calls from the pool, for one block access by a request:

1. ``find(key)``: True on a hit (the policy updates its order; the pool pins a
   cached key before this call, so a hit never re-orders a block that ``pin``
   would take out of the order again). On a miss the
   policy may learn from its history (ARC's ghost hit moves its target) and
   remembers ``key`` as the pending insertion.
2. On a miss, while the pool has no free block: ``victim = to_evict()``, a
   read-only choice among unpinned resident keys, then ``evict(victim)``.
3. On a miss: ``insert(key)``; the pool then pins the key.
4. ``pin(key)`` when a key's reference count goes 0 -> 1, ``unpin(key)`` when it
   goes 1 -> 0. Only unpinned resident keys are candidates; an ``insert``ed key
   starts pinned.

``remove(key)`` drops a resident, unpinned key without keeping history (prefix
cache reset, explicit invalidation).

Batched calls, one per pool operation instead of one per block (the pool's loop then
costs no Python call per block when the policies are compiled); each is exactly the
per-key calls above in the order given, and a policy may override one with a shorter
path that leaves the same state:

- ``touch(keys, newly_pinned)``: a request commits its cached prefix (tail first);
- ``allocate(keys, free, copy)``: a request's new blocks, tail first, with ``free``
  blocks free that hold no key (the pool evicts only once those are used up);
- ``release(keys)``: a request's last user releases its cached keys;
- ``serve_alone(keys, max_hits)``: a whole request while no other holds a block (a
  simulator's sequential mode): its ``touch``, ``allocate`` and ``release``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import ClassVar, TypeVar

_T = TypeVar("_T")

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # mypyc reads the decorator at build time; no run-time dependency

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_T], _T]:
        return lambda cls: cls


Key = Hashable


def refuse_copy(key: Key) -> Key:
    """``allocate``'s ``copy`` for a caller whose keys are all uncached (a pool keyed by the
    policy's own keys never makes a copy): a resident key is the caller's bookkeeping error."""
    raise AssertionError(f"{key!r} is resident, yet the caller has it uncached")


class PolicyError(ValueError):
    """A policy was asked for by a name or with parameters it does not accept."""


# The simulator's Belady oracle and test doubles subclass this in plain Python.
@mypyc_attr(allow_interpreted_subclasses=True)
class EvictionPolicy(ABC):
    """Base class: capacity and the call protocol above.

    What a policy reports for metrics is a protocol of its own,
    ``statistics.ReportsStatistics``: eviction reads none of it.

    Invariants every subclass keeps (checked by ``verify``):
    - the resident keys are exactly those inserted and not yet evicted or removed;
    - ``to_evict`` never returns a pinned key and never changes state;
    - ``len(self)`` (resident keys) never exceeds ``capacity``.
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise PolicyError(f"capacity must be at least 1 block, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def find(self, key: Key) -> bool:
        """A request is about to use ``key``: True if resident (and update order)."""

    @abstractmethod
    def insert(self, key: Key) -> None:
        """``key`` (the pending miss of the last ``find``) becomes resident and pinned."""

    @abstractmethod
    def to_evict(self) -> Key | None:
        """The next victim among unpinned resident keys, or None; changes nothing."""

    @abstractmethod
    def evict(self, key: Key) -> None:
        """Remove ``key``, the victim ``to_evict`` just named."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Drop resident, unpinned ``key`` without keeping history for it."""

    @abstractmethod
    def pin(self, key: Key) -> None:
        """``key`` is now in use: never a candidate until ``unpin``."""

    @abstractmethod
    def unpin(self, key: Key) -> None:
        """``key`` was released by its last user: a candidate again."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """True if ``key`` is resident (ghost entries do not count)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys, pinned or not."""

    @abstractmethod
    def resident_keys(self) -> Iterator[Key]:
        """Every resident key, least recently used first (for a live policy switch)."""

    @abstractmethod
    def verify(self) -> None:
        """Recount every structure; raise AssertionError naming what is out of sync."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all history (statistics' counters keep counting)."""

    def access(self, key: Key) -> bool:
        """One access of ``key`` in a cache that holds no pins: True on a hit.

        libCacheSim's ``get``, for simulating a cache beside the real one (``trio``'s
        miniatures): find, make room and insert on a miss, and release at once. The
        calls are the plain driver's (``find`` before ``pin``; every policy's ``find``
        accepts an unpinned resident key). Policies may override it with a shorter
        path that leaves the same keys in the same order.
        """
        hit = self.find(key)
        if hit:
            self.pin(key)
        else:
            if len(self) == self.capacity:  # no pins: one victim makes room
                self.evict(self.to_evict())
            self.insert(key)
        self.unpin(key)
        return hit

    def touch(self, keys: Sequence[Key], newly_pinned: Sequence[bool]) -> None:
        """A request commits its cached prefix, given tail first: for each key, ``pin``
        when ``newly_pinned`` (its reference count goes 0 -> 1), then ``find``."""
        for index in range(len(keys)):
            key = keys[index]
            if newly_pinned[index]:
                self.pin(key)
            self.find(key)

    def allocate(
        self, keys: Sequence[Key | None], free: int, copy: Callable[[Key], Key]
    ) -> tuple[list[Key | None], list[Key]]:
        """New blocks for ``keys`` (head first, None: a block without a key), tail first.

        Per block: ``find`` its entry (the key, or ``copy(key)`` while the key itself is
        resident: a further copy), take one of the ``free`` blocks that hold no key or
        else evict ``to_evict()``'s victim, then ``insert`` the entry. Returns each
        block's entry (head first) and the victims in eviction order. Raises
        RuntimeError when no victim is left; the caller checked there is one.
        """
        entries: list[Key | None] = [None] * len(keys)
        victims: list[Key] = []
        for index in range(len(keys) - 1, -1, -1):
            key = keys[index]
            if key is not None:
                if key in self:
                    key = copy(key)
                self.find(key)  # a ghost hit adapts ARC's target before the victim
            if free:
                free -= 1
            else:
                victim = self.to_evict()
                if victim is None:
                    raise self.no_victim()
                self.evict(victim)
                victims.append(victim)
            if key is not None:
                self.insert(key)
                entries[index] = key
        return entries, victims

    def no_victim(self) -> RuntimeError:
        """The error ``allocate`` raises when no unpinned key is left to evict."""
        return RuntimeError(
            f"policy {self.describe()} named no victim with {len(self)} resident keys"
        )

    def release(self, keys: Sequence[Key]) -> None:
        """``unpin`` each key, in the order given (a finished request: tail first)."""
        for key in keys:
            self.unpin(key)

    def serve_alone(self, keys: Sequence[Key], max_hits: int) -> tuple[int, list[Key], list[Key]]:
        """A request of distinct ``keys`` (head first, at most ``capacity``) taken and given
        back while no other request holds a block: the calls a pool makes, in its order.

        The cached prefix (at most ``max_hits`` blocks), then the request's other cached
        blocks, are taken tail first (``touch``, every one newly pinned); the uncached ones are
        allocated (``allocate``, the pool's free blocks being those no key holds); then every
        block is released tail first (``release``). Returns the prefix hits, the keys cached
        by this request and the keys evicted for them.
        """
        count = len(keys)
        hits = 0
        while hits < count and keys[hits] in self:
            hits += 1
        hits = min(hits, max_hits)
        taken: list[Key] = [keys[index] for index in range(hits - 1, -1, -1)]
        missed: list[Key] = []
        for index in range(count - 1, hits - 1, -1):
            key = keys[index]
            if key in self:
                taken.append(key)
            else:
                missed.append(key)
        missed.reverse()  # head first, as allocate takes them
        if taken:
            self.touch(taken, [True] * len(taken))
        victims: list[Key] = []
        if missed:
            _entries, victims = self.allocate(missed, self.capacity - len(self), refuse_copy)
        self.release(keys[::-1])
        return hits, missed, victims

    def describe(self) -> str:
        """The policy with its parameters, e.g. ``s3fifo-0.10-2``."""
        return self.name
