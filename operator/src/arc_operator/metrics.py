"""Read a vLLM pod's /metrics text and turn successive readings into a hit rate.

Pure functions: the handler fetches the text and keeps the previous readings.

- The active policy is the ``policy`` label of ``arc_evictor_policy_info`` samples whose
  value is 1 (the plugin sets exactly one; none means the plugin is not active).
- The hit rate is token-level, from vLLM's ``vllm:prefix_cache_hits_total`` and
  ``vllm:prefix_cache_queries_total`` (summed over their label sets, e.g. engines), as a
  rate over the interval between two readings, summed over pods. A counter that went down
  was reset (the pod restarted), so its whole current value counts, as Prometheus'
  ``rate()`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from arc_serving_common.names import METRIC_NAMES

# The plugin names its metrics once; its info gauge is the one ending in _policy_info.
(POLICY_INFO,) = (name for name in METRIC_NAMES if name.endswith("_policy_info"))
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


class MetricsError(ValueError):
    """A /metrics text that cannot be parsed."""


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One reading of one pod: its reported policies and its prefix-cache counters."""

    policies: frozenset[str]
    hits: float
    queries: float


def parse_metrics(text: str) -> PodMetrics:
    """Parse a Prometheus text exposition; raise MetricsError for malformed text."""
    policies: set[str] = set()
    hits = queries = 0.0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == POLICY_INFO and sample.value == 1:
                    policies.add(sample.labels.get("policy", ""))
                elif sample.name == HITS:
                    hits += sample.value
                elif sample.name == QUERIES:
                    queries += sample.value
    except ValueError as error:
        raise MetricsError(f"malformed /metrics text: {error}") from error
    return PodMetrics(frozenset(policies - {""}), hits, queries)


def _increase(before: float, after: float) -> float:
    # A decrease means the counter restarted from zero.
    return after - before if after >= before else after


def pod_hit_rates(
    previous: Mapping[str, PodMetrics], current: Mapping[str, PodMetrics]
) -> dict[str, float | None]:
    """Each pod's own hit rate between two readings (``hit_rate`` of that pod alone), for the
    pods present in both: how well routing keeps each replica's prefixes together."""
    return {
        pod: hit_rate({pod: previous[pod]}, {pod: now})
        for pod, now in sorted(current.items())
        if pod in previous
    }


def hit_rate(previous: Mapping[str, PodMetrics], current: Mapping[str, PodMetrics]) -> float | None:
    """Hits over queries between two readings of the pods present in both.

    None when no pod was read twice or there were no queries in between (a rate of
    nothing is undefined, not 0).
    """
    hits = queries = 0.0
    for pod, now in current.items():
        before = previous.get(pod)
        if before is None:
            continue
        hits += _increase(before.hits, now.hits)
        queries += _increase(before.queries, now.queries)
    if queries <= 0:
        return None
    return min(1.0, max(0.0, hits / queries))
