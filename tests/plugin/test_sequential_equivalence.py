"""In a sequential replay the plugin inside vLLM's real manager decides exactly as the simulator.

A workload is a list of block chains (hash ids of whole blocks). Each hash id gets ``BS`` token
ids from a generator seeded by (seed, hash id), so vLLM's chained block hashes coincide exactly
when two chains share a prefix. The simulator is fed vLLM's own block keys (one per block), so a
policy that samples keys by their hash (trio above 1,024 blocks) samples the same keys on both
sides, and the final eviction orders can be compared key for key.

Two differences are made explicit rather than hidden. The simulator's pool model caches full
blocks only and does not model the block that holds a prompt's partial last block, which vLLM
allocates (and pins) for the request's duration: every prompt is whole blocks on both sides.
And the simulator takes a cached block that follows a request's first miss (or a fully cached
prompt's last block) as it is, where vLLM, with the plugin as without, computes it into a
fresh block that becomes a second cached copy: every request therefore ends in a block of its
own. With that, hits, evictions, ghost hits and the eviction order are equal for every policy
that evicts a prefix's tail before its head. S3-FIFO's small FIFO evicts heads before tails,
so vLLM recomputes cached tails into copies on every workload tried and S3-FIFO is not
compared (docs/plugin.md, "Equal to vLLM").
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from managers import admit, make_manager, make_request
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from arc_evictor.policies import make_policy, policy_names
from arc_serving_common.traces import TraceRequest, load_trace
from arc_simulator.generate import DocQAParams, docqa, write_generated
from arc_simulator.simulate import simulate_sequential

BS = 4


def block_tokens(hash_id: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + hash_id)
    return [rng.randrange(4, 30_000) for _ in range(BS)]


def with_unique_tails(chains: list[list[int]]) -> list[list[int]]:
    """Each chain with one block no other request has, so no request re-sends a cached tail."""
    return [[*chain, 2 * 10**9 + index] for index, chain in enumerate(chains)]


def replay_both(policy: str, capacity: int, chains: list[list[int]], seed: int) -> None:
    """Replay ``chains`` in the simulator and through vLLM, one request at a time; assert equal
    hits, evictions, ghost hits and final eviction order, and that vLLM made no second copy."""
    requests, vllm_requests = [], []
    for index, chain in enumerate(chains):
        vllm_request = make_request([t for h in chain for t in block_tokens(h, seed)], BS)
        keys = tuple(make_block_hash_with_group_id(h, 0) for h in vllm_request.block_hashes)
        assert len(keys) == len(chain)
        requests.append(
            TraceRequest(
                index=index,
                line=index + 1,
                timestamp_s=float(index),
                input_length=len(chain) * BS,
                output_length=1,
                hash_ids=tuple(chain),
                keys=keys,  # type: ignore[arg-type]  (any hashable key; vLLM's are bytes)
                block_tokens=BS,
            )
        )
        vllm_requests.append(vllm_request)
    simulated = make_policy(policy, capacity)
    expected = simulate_sequential(requests, simulated)
    assert expected.rejected_requests == 0

    manager = make_manager(policy, num_blocks=capacity + 1, block_size=BS)  # + the null block
    pool = manager.block_pool
    assert pool.policy.describe() == simulated.describe()
    hits = 0
    for request, vllm_request in zip(requests, vllm_requests, strict=True):
        got = admit(manager, vllm_request)
        assert got is not None, f"request {request.index} did not fit"
        hits += got
        manager.free(vllm_request)
    pool.verify()
    copies = [entry for entry in pool.policy.resident_keys() if isinstance(entry, tuple)]
    assert not copies, f"vLLM computed {len(copies)} cached blocks again (see module docstring)"

    assert expected.block_hits > 0 and expected.evictions > 0
    assert hits == pool.block_hits == expected.block_hits
    assert sum(pool.policy.counters.evictions.values()) == expected.evictions
    assert pool.policy.counters.ghost_hits == expected.ghost_hits
    # The same keys resident, in the same eviction order.
    assert list(pool.policy.resident_keys()) == list(simulated.resident_keys())


@pytest.mark.parametrize("policy", [name for name in policy_names() if name != "s3fifo"])
def test_sequential_replay_matches_simulator(tmp_path: Path, policy: str) -> None:
    params = DocQAParams(
        documents=30,
        document_tokens=2_500,
        questions_per_document=6.0,
        question_tokens=600,
        output_tokens=1,
        seed=3,
    )
    path = tmp_path / "docqa.jsonl"
    write_generated(path, docqa(params), "mooncake")
    chains = [list(r.hash_ids[: r.num_blocks]) for r in load_trace(path) if r.num_blocks]
    assert len(chains) > 100
    # 24 blocks; documents are 5 blocks, so the hot set does not fit.
    replay_both(policy, 24, with_unique_tails(chains), params.seed)


def shared_prefix_chains(seed: int, requests: int) -> list[list[int]]:
    """Prefixes of random length of Zipf-popular long documents, each with a unique tail."""
    rng = random.Random(seed)
    documents, longest = 60, 120
    weights = [1 / (rank + 1) for rank in range(documents)]
    unique = 10**9
    chains = []
    for _ in range(requests):
        document = rng.choices(range(documents), weights)[0]
        chain = [document * 100_000 + block for block in range(rng.randint(1, longest))]
        tail = rng.randint(1, 3)
        chain += range(unique, unique + tail)
        unique += tail
        chains.append(chain)
    return chains


def test_sampling_trio_above_1024_blocks_matches_simulator() -> None:
    # Above 1,024 blocks trio's miniatures see 1 key in 8, and which of a request's sampled
    # keys fall in which scoring window follows the order of the finds: the cached prefix
    # tail first on both sides (vLLM's touch gets it head first). Prefixes of varied length
    # over long documents make that order matter: with seed 2, taking the prefix head first
    # changes the hits.
    replay_both("trio", 1_100, shared_prefix_chains(2, 1_500), 2)
