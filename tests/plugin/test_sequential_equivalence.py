"""In a sequential replay the plugin inside vLLM's real manager decides exactly as the simulator.

The trace is the project's own document-QA generator in Mooncake form, read back with
``read_trace``. Each hash id gets ``BS`` token ids from a generator seeded by (seed, hash id),
so vLLM's chained block hashes coincide exactly when the trace's chain keys do.

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

from arc_evictor.generate import DocQAParams, docqa, write_generated
from arc_evictor.policies import make_policy, policy_names
from arc_evictor.simulate import simulate_sequential
from arc_evictor.traces import TraceRequest, load_trace

BS = 4


def whole_block_trace(tmp_path: Path, seed: int) -> list[TraceRequest]:
    params = DocQAParams(
        documents=30,
        document_tokens=2_500,
        questions_per_document=6.0,
        question_tokens=600,
        output_tokens=1,
        seed=seed,
    )
    path = tmp_path / f"docqa-{seed}.jsonl"
    write_generated(path, docqa(params), "mooncake")
    requests = [
        dataclasses.replace(r, input_length=r.num_blocks * r.block_tokens)
        for r in load_trace(path)
        if r.num_blocks > 0
    ]
    assert len(requests) > 100
    return requests


def block_tokens(hash_id: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + hash_id)
    return [rng.randrange(4, 30_000) for _ in range(BS)]


@pytest.mark.parametrize("policy", policy_names())
def test_sequential_replay_matches_simulator(tmp_path: Path, policy: str) -> None:
    seed = 3
    requests = whole_block_trace(tmp_path, seed)
    capacity = 24  # blocks; documents are 5 blocks, so the hot set does not fit
    expected = simulate_sequential(requests, make_policy(policy, capacity))
    assert expected.rejected_requests == 0

    manager = make_manager(policy, num_blocks=capacity + 1, block_size=BS)  # + the null block
    pool = manager.block_pool
    hits = 0
    for request in requests:
        tokens = [
            t
            for hash_id in request.hash_ids[: request.num_blocks]
            for t in block_tokens(hash_id, seed)
        ]
        vllm_request = make_request(tokens, BS)
        got = admit(manager, vllm_request)
        assert got is not None, f"request {request.index} did not fit"
        hits += got
        manager.free(vllm_request)
        pool.verify()

    assert expected.block_hits > 0 and expected.evictions > 0
    assert hits == pool.block_hits == expected.block_hits
    assert sum(pool.policy.counters.evictions.values()) == expected.evictions
    assert pool.policy.counters.ghost_hits == expected.ghost_hits
