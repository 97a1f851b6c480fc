"""Eviction policies for a KV block pool, behind one interface (``EvictionPolicy``).

The registry maps stable lower-case names to factories; ``make_policy`` is the
only way the simulator and the vLLM plugin build a policy. Every registered policy
also reports statistics for metrics (``ReportsStatistics``).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.machinery import EXTENSION_SUFFIXES

from arc_evictor.policies import arc, base, lfu, lru, s3fifo, sieve, trio
from arc_evictor.policies.arc import ARC, DBL
from arc_evictor.policies.base import EvictionPolicy, Key, PolicyError
from arc_evictor.policies.lru import LRU
from arc_evictor.policies.s3fifo import S3FIFO
from arc_evictor.policies.sieve import Sieve
from arc_evictor.policies.statistics import PolicyCounters, ReportsStatistics
from arc_evictor.policies.trio import Trio

PolicyFactory = Callable[[int], EvictionPolicy]

REGISTRY: dict[str, PolicyFactory] = {
    "lru": LRU,
    "dbl": DBL,
    "arc": ARC,
    "s3fifo": S3FIFO,
    "sieve": Sieve,
    "trio": Trio,
}


def compiled() -> bool:
    """True when every policy module was loaded from its compiled extension (mypyc), False
    when every one is Python source; a mix means a broken build and raises RuntimeError."""
    modules = (base, lru, arc, lfu, s3fifo, sieve, trio)
    native = {m.__name__: (m.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES)) for m in modules}
    if len(set(native.values())) != 1:
        raise RuntimeError(f"policy modules partly compiled: {native}")
    return native["arc_evictor.policies.base"]


def policy_names() -> list[str]:
    """Every valid policy name, in registry order."""
    return list(REGISTRY)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build policy ``name`` for a pool of ``capacity`` cacheable blocks.

    Raises PolicyError naming the valid choices for an unknown name.
    """
    factory = REGISTRY.get(name.strip().lower()) if isinstance(name, str) else None
    if factory is None:
        raise PolicyError(
            f"unknown eviction policy {name!r}; valid policies: {', '.join(policy_names())}"
        )
    return factory(capacity)


__all__ = [
    "ARC",
    "DBL",
    "LRU",
    "REGISTRY",
    "S3FIFO",
    "EvictionPolicy",
    "Key",
    "PolicyCounters",
    "PolicyError",
    "ReportsStatistics",
    "Sieve",
    "Trio",
    "compiled",
    "make_policy",
    "policy_names",
]
