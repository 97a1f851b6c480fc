"""In a sequential replay the plugin inside vLLM's real manager decides exactly as the simulator.

The trace is the project's own document-QA generator in Mooncake form, read back with
``read_trace``. Each hash id gets ``BS`` token ids from a generator seeded by (seed, hash id),
so vLLM's chained block hashes coincide exactly when the trace's chain keys do. The simulator
is then fed vLLM's own block keys in place of the chain keys (one for one), so that a policy
that samples keys by their hash (trio above 1,024 blocks) samples the same keys on both sides.

One difference is made explicit rather than hidden: the simulator's pool model caches full
blocks only and does not model the block that holds a prompt's partial last block, which vLLM
allocates (and pins) for the request's duration. The replay therefore trims every prompt to
whole blocks (``input_length = blocks * block_tokens``) on both sides; with that, hits,
evictions and ghost hits are equal for every policy.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from harness import admit, make_manager, make_request
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from arc_evictor.generate import (
    ConversationParams,
    DocQAParams,
    GeneratedRequest,
    conversation,
    docqa,
    write_generated,
)
from arc_evictor.policies import make_policy, policy_names
from arc_evictor.simulate import simulate_sequential
from arc_evictor.traces import load_trace

BS = 4


def block_tokens(hash_id: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + hash_id)
    return [rng.randrange(4, 30_000) for _ in range(BS)]


def replay_both(
    tmp_path: Path, policy: str, capacity: int, generated: list[GeneratedRequest], seed: int
) -> None:
    """Replay ``generated`` trimmed to whole blocks in the simulator and through vLLM; assert
    equal hits, evictions, ghost hits and final eviction order."""
    path = tmp_path / "trace.jsonl"
    write_generated(path, generated, "mooncake")
    requests, vllm_requests = [], []
    for r in load_trace(path):
        if r.num_blocks == 0:
            continue
        tokens = [
            t for hash_id in r.hash_ids[: r.num_blocks] for t in block_tokens(hash_id, seed)
        ]
        vllm_request = make_request(tokens, BS)
        keys = tuple(make_block_hash_with_group_id(h, 0) for h in vllm_request.block_hashes)
        assert len(keys) == r.num_blocks
        requests.append(
            dataclasses.replace(r, input_length=r.num_blocks * r.block_tokens, keys=keys)
        )
        vllm_requests.append(vllm_request)
    assert len(requests) > 100
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

    assert expected.block_hits > 0 and expected.evictions > 0
    assert hits == pool.block_hits == expected.block_hits
    assert sum(pool.policy.counters.evictions.values()) == expected.evictions
    assert pool.policy.counters.ghost_hits == expected.ghost_hits
    # The same keys, in the same eviction order.
    assert list(pool.policy.resident_keys()) == list(simulated.resident_keys())


@pytest.mark.parametrize("policy", policy_names())
def test_sequential_replay_matches_simulator(tmp_path: Path, policy: str) -> None:
    params = DocQAParams(
        documents=30,
        document_tokens=2_500,
        questions_per_document=6.0,
        question_tokens=600,
        output_tokens=1,
        seed=3,
    )
    # 24 blocks; documents are 5 blocks, so the hot set does not fit.
    replay_both(tmp_path, policy, 24, docqa(params), params.seed)


def test_sampling_trio_above_1024_blocks_matches_simulator(tmp_path: Path) -> None:
    # Above 1,024 blocks trio's miniatures see 1 key in 8, picked by the key's hash, and each
    # miniature's order follows the order of the finds: tail first on both sides.
    params = DocQAParams(
        documents=600,
        document_tokens=2_500,
        questions_per_document=8.0,
        question_tokens=600,
        output_tokens=1,
        seed=5,
    )
    replay_both(tmp_path, "trio", 1_100, docqa(params), params.seed)
