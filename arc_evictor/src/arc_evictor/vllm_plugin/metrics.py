"""The plugin's Prometheus metrics, written from the engine core process.

vLLM's API server serves ``/metrics`` from prometheus_client's multiprocess collector when
``PROMETHEUS_MULTIPROC_DIR`` is set; the engine core runs in another process, so these metrics
only reach ``/metrics`` in that mode (``arc_harness.vllm_server`` sets it; pods must too).
Gauges carry a ``multiprocess_mode`` so values from several engine cores combine sensibly.

Counters are published as deltas of the pool's and the policy's own counts at step boundaries
(``PluginMetrics.sync``), so the hot block-pool path only increments plain integers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from arc_evictor.policies import ReportsStatistics, policy_names

if TYPE_CHECKING:
    from arc_evictor.vllm_plugin.block_pool import PolicyBlockPool


def multiprocess_enabled() -> bool:
    """True when prometheus_client writes values to files the API server can read."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


class PluginMetrics:
    """The metric objects and what has been published of each pool's counts so far.

    Invariant: for every pool, ``_published[id(pool)]`` holds the counts already added to the
    Prometheus counters, so each ``sync`` adds exactly the events since the last one; its
    ``"switches"`` entry is the pool's ``policy_switches`` at the last sync, so a different
    count means the pool runs a policy not synced yet (or the pool is new).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kwargs = {} if registry is None else {"registry": registry}
        # Counter names omit "_total": prometheus_client appends it.
        self.policy_info = Gauge(
            "arc_evictor_policy_info",
            "Active eviction policy (1) per policy name.",
            ["policy"],
            multiprocess_mode="livemax",
            **kwargs,
        )
        self.block_queries = Counter(
            "arc_evictor_block_queries", "Full prompt blocks looked up at admission.", **kwargs
        )
        self.block_hits = Counter(
            "arc_evictor_block_hits", "Cached blocks committed to a request.", **kwargs
        )
        self.ghost_hits = Counter(
            "arc_evictor_ghost_hits", "Misses found in a ghost list.", ["list"], **kwargs
        )
        self.evictions = Counter(
            "arc_evictor_evictions", "Cached blocks evicted, per policy list.", ["list"], **kwargs
        )
        self.resident = Gauge(
            "arc_evictor_resident_blocks",
            "Cached blocks per policy list.",
            ["list"],
            multiprocess_mode="livesum",
            **kwargs,
        )
        self.ghosts = Gauge(
            "arc_evictor_ghost_blocks",
            "Remembered evicted keys per ghost list.",
            ["list"],
            multiprocess_mode="livesum",
            **kwargs,
        )
        self.target = Gauge(
            "arc_evictor_target_recency_blocks",
            "ARC's target size p of the recency list T1, in blocks.",
            multiprocess_mode="livemostrecent",
            **kwargs,
        )
        self.switches = Counter("arc_evictor_policy_switches", "Live policy switches.", **kwargs)
        # ARC's ghost lists b1 and b2 have series from the start (reading 0), whatever the policy.
        for lst in ("b1", "b2"):
            self.ghost_hits.labels(list=lst)
            self.ghosts.labels(list=lst).set(0)
        self._published: dict[int, dict[str, int]] = {}
        self._lists_seen: set[tuple[str, str]] = set()

    def sync(self, pool: PolicyBlockPool) -> None:
        """Publish ``pool``'s counts and its policy's list sizes."""
        done = self._published.setdefault(id(pool), {})
        policy = pool.policy
        if done.get("switches") != pool.policy_switches:
            # A new policy counts from zero: forget what the old one had published.
            for name in [k for k in done if k.startswith(("ev:", "gh:"))]:
                del done[name]
            for name in policy_names():
                self.policy_info.labels(policy=name).set(1 if name == policy.name else 0)
        self._add(done, "queries", pool.block_queries, self.block_queries)
        self._add(done, "hits", pool.block_hits, self.block_hits)
        self._add(done, "switches", pool.policy_switches, self.switches)
        # Every registered policy reports statistics next to its eviction order.
        statistics: ReportsStatistics = policy
        for lst, count in statistics.counters.evictions.items():
            self._add(done, "ev:" + lst, count, self.evictions.labels(list=lst))
        for lst, count in statistics.counters.ghost_hits.items():
            self._add(done, "gh:" + lst, count, self.ghost_hits.labels(list=lst))
        sizes = statistics.list_sizes()
        current: set[tuple[str, str]] = set()
        for lst in statistics.resident_lists:
            self.evictions.labels(list=lst)
            self.resident.labels(list=lst).set(sizes.get(lst, 0))
            current.add(("r", lst))
        for lst in statistics.ghost_lists:
            self.ghosts.labels(list=lst).set(sizes.get(lst, 0))
            current.add(("g", lst))
        for kind, lst in self._lists_seen - current:
            # Lists of a policy switched away from read 0, not their last value.
            (self.resident if kind == "r" else self.ghosts).labels(list=lst).set(0)
        self._lists_seen |= current
        target = statistics.target
        self.target.set(target if target is not None else 0.0)

    @staticmethod
    def _add(done: dict[str, int], name: str, value: int, counter: Counter) -> None:
        delta = value - done.get(name, 0)
        if delta > 0:
            counter.inc(delta)
        done[name] = value
