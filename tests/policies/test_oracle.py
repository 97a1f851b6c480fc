"""Oracle: on plain key sequences our policies give exactly libCacheSim's hit counts.

libcachesim 0.3.5 (PyPI) is the reference. Its ARC keeps ``p`` as a double (the
paper's float target), so ``arc`` matches exactly.
S3-FIFO is checked at capacities of 20 blocks and more: below that libCacheSim admits
nothing or aborts (see arc_evictor/policies/s3fifo.py).
"""

from __future__ import annotations

import functools

import libcachesim
import pytest
from policy_support import libcachesim_hits, run_plain, scan_mixed_keys, uniform_keys, zipf_keys

from arc_evictor.policies import make_policy

N_KEYS = 20_000
UNIVERSE = 5_000

REFERENCES = {
    "lru": libcachesim.LRU,
    "arc": libcachesim.ARC,
    "s3fifo": libcachesim.S3FIFO,
    "sieve": libcachesim.Sieve,
}

SEQUENCES = {
    "uniform": lambda: uniform_keys(N_KEYS, 3_000, seed=1),
    "zipf-0.8": lambda: zipf_keys(N_KEYS, 0.8, UNIVERSE, seed=2),
    "zipf-1.0": lambda: zipf_keys(N_KEYS, 1.0, UNIVERSE, seed=3),
    "zipf-1.2": lambda: zipf_keys(N_KEYS, 1.2, UNIVERSE, seed=4),
    "scan-mixed": lambda: scan_mixed_keys(N_KEYS, 1.0, UNIVERSE, seed=5),
}


@functools.cache
def sequence(name: str) -> list[int]:
    return SEQUENCES[name]()


@pytest.mark.parametrize("capacity", [50, 200, 1000])
@pytest.mark.parametrize("sequence_name", list(SEQUENCES))
@pytest.mark.parametrize("policy_name", list(REFERENCES))
def test_hit_count_equals_libcachesim(policy_name: str, sequence_name: str, capacity: int) -> None:
    keys = sequence(sequence_name)
    ours = run_plain(make_policy(policy_name, capacity), keys)
    reference = libcachesim_hits(REFERENCES[policy_name], capacity, keys)
    assert ours == reference
    # A sequence where every policy hits almost never or always would prove little.
    assert 0.01 * len(keys) < ours < 0.99 * len(keys)


def test_scan_mixed_sequence_alternates_zipf_and_scans_of_new_keys() -> None:
    keys = sequence("scan-mixed")
    assert len(keys) == N_KEYS
    assert all(key < UNIVERSE for key in keys[:2000])
    first_scan, second_scan = keys[2000:3500], keys[5500:7000]
    assert all(key >= UNIVERSE for key in first_scan + second_scan)
    assert len(set(first_scan + second_scan)) == 3000


def test_policies_disagree_on_skewed_traffic() -> None:
    # Guards the oracle against a driver that would make every policy behave alike.
    keys = sequence("scan-mixed")
    hits = {name: run_plain(make_policy(name, 200), keys) for name in REFERENCES}
    assert len(set(hits.values())) == len(hits)
