"""Properties on random operation sequences with pinning, for every registered policy.

The test keeps its own model of the pool (reference counts per key, the resident set)
and drives the policy through the contract in arc_evictor/policies/base.py; ``verify``
runs after every operation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arc_evictor.policies import ARC, S3FIFO, EvictionPolicy, make_policy, policy_names

OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["access", "touch", "release", "remove", "evict"]), st.integers(0, 15)
    ),
    max_size=100,
)

# Every registered policy, plus variants whose paths the defaults rarely reach at small
# capacities (S3-FIFO's small FIFO holds one block below 20 blocks).
FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    **{name: functools.partial(make_policy, name) for name in policy_names()},
    "s3fifo-0.50-1": functools.partial(S3FIFO, small_ratio=0.5, move_to_main_threshold=1),
    "s3fifo-0.40-2": functools.partial(S3FIFO, small_ratio=0.4, ghost_ratio=0.5),
}


@dataclass
class PoolModel:
    """What the pool knows: references per key and which keys it holds."""

    policy: EvictionPolicy
    refs: dict[int, int] = field(default_factory=dict)
    resident: set[int] = field(default_factory=set)
    evicted: set[int] = field(default_factory=set)

    def evict_one(self) -> bool:
        victim = self.policy.to_evict()
        if victim is None:
            return False
        assert self.refs.get(victim, 0) == 0, f"victim {victim!r} is pinned"
        self.policy.evict(victim)
        self.resident.discard(victim)
        self.evicted.add(victim)
        return True

    def access(self, key: int) -> None:
        policy = self.policy
        if self.refs.get(key, 0) > 0:
            assert policy.find(key), f"pinned {key!r} missed"
            self.refs[key] += 1
            return
        if policy.find(key):
            assert key in self.resident, f"{key!r} hit but the pool never kept it"
            policy.pin(key)
            self.refs[key] = 1
            return
        assert key not in self.resident, f"resident {key!r} missed"
        while len(policy) >= policy.capacity:
            if not self.evict_one():
                return  # every block is pinned: the pool turns the request away
        policy.insert(key)
        self.refs[key] = 1
        self.resident.add(key)
        self.evicted.discard(key)

    def touch(self, key: int) -> None:
        """A request that uses ``key`` and finishes at once."""
        self.access(key)
        if self.refs.get(key, 0) > 0:
            self.release_key(key)

    def release_key(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.policy.unpin(key)

    def release(self, index: int) -> None:
        """Drop one reference of the ``index``-th pinned key (modulo their number)."""
        pinned = sorted(key for key, refs in self.refs.items() if refs > 0)
        if pinned:
            self.release_key(pinned[index % len(pinned)])

    def remove(self, index: int) -> None:
        """Remove the ``index``-th unpinned resident key (modulo their number)."""
        unpinned = sorted(key for key in self.resident if self.refs.get(key, 0) == 0)
        if unpinned:
            key = unpinned[index % len(unpinned)]
            self.policy.remove(key)
            self.resident.discard(key)

    def check(self) -> None:
        policy = self.policy
        policy.verify()
        assert len(policy) <= policy.capacity
        assert set(policy.resident_keys()) == self.resident
        assert len(policy) == len(self.resident)
        assert all(key in policy for key, refs in self.refs.items() if refs > 0)
        assert not any(key in policy for key in self.evicted)
        sizes = policy.list_sizes()
        before = (sizes, list(policy.resident_keys()), policy.target)
        victim = policy.to_evict()
        assert victim is None or self.refs.get(victim, 0) == 0
        assert (policy.list_sizes(), list(policy.resident_keys()), policy.target) == before
        if isinstance(policy, ARC):
            c = policy.capacity
            assert sizes["t1"] + sizes["t2"] <= c
            assert sizes["t1"] + sizes["b1"] <= c
            assert sum(sizes.values()) <= 2 * c
            assert 0 <= policy.target <= c
            if not policy.adaptive:
                assert policy.target == c / 2


@pytest.mark.parametrize("variant", list(FACTORIES))
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 8), operations=OPERATIONS)
def test_random_operations_keep_every_invariant(
    variant: str, capacity: int, operations: list[tuple[str, int]]
) -> None:
    model = PoolModel(FACTORIES[variant](capacity))
    for operation, key in operations:
        if operation == "evict":
            model.evict_one()
        else:
            getattr(model, operation)(key)
        model.check()
