"""What a policy reports besides its eviction order: list sizes, event counts, ARC's target.

Eviction never reads these; the plugin's metrics (``arc_evictor.vllm_plugin.metrics``, the
metric names in docs/architecture.md) and the simulator's results do. Every registered
policy implements ``ReportsStatistics`` next to ``EvictionPolicy``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable


@dataclass(slots=True)
class PolicyCounters:
    """Event counts per list name, only ever increased (``clear`` keeps them)."""

    evictions: dict[str, int] = field(default_factory=dict)
    ghost_hits: dict[str, int] = field(default_factory=dict)

    def count_eviction(self, list_name: str) -> None:
        self.evictions[list_name] = self.evictions.get(list_name, 0) + 1

    def count_ghost_hit(self, list_name: str) -> None:
        self.ghost_hits[list_name] = self.ghost_hits.get(list_name, 0) + 1


@runtime_checkable
class ReportsStatistics(Protocol):
    """A policy's statistics for metrics.

    Invariants: ``list_sizes`` names exactly ``resident_lists`` then ``ghost_lists``, in
    that order, and its resident sizes sum to the number of resident keys; every list name
    in ``counters.evictions`` is a resident list, every one in ``counters.ghost_hits`` a
    ghost list.
    """

    # List names, the ``list`` label of the metrics (``t1``, ``t2``, ``b1``, ``b2`` for ARC).
    resident_lists: ClassVar[tuple[str, ...]]
    ghost_lists: ClassVar[tuple[str, ...]] = ()
    counters: PolicyCounters

    @abstractmethod
    def list_sizes(self) -> dict[str, int]:
        """Resident keys per resident list, then remembered keys per ghost list."""

    @property
    def target(self) -> float | None:
        """ARC's adaptive target ``p`` for T1, in blocks; None for a policy without one."""
        return None
