"""One policy over every KV cache group, or one policy per group: the measurement.

Run: ``.venv/bin/python tests/plugin/measure_groups.py`` (about a minute). A generated DocQA
trace (40 documents, seed 5) is replayed one request at a time through vLLM's real
KVCacheManager with a full-attention and a sliding-window group sharing one pool of 120
blocks, and the prompt-token hit rate is printed for vLLM's own pool, for one policy over
``BlockHashWithGroupId`` keys (what the plugin does), and for one policy per group with an
even split of the pool (the victim comes from the group furthest over its share). The share
of the pool each group's cached blocks hold is printed too. docs/plugin.md quotes the output.
"""

from __future__ import annotations

import random
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from managers import make_manager, make_request

from vllm.v1.core.kv_cache_utils import get_group_id

from arc_evictor.policies import REGISTRY, EvictionPolicy, Key, make_policy
from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.block_pool import hash_of
from arc_serving_common.traces import load_trace
from arc_simulator.generate import DocQAParams, docqa, write_generated

BS = 4
NUM_BLOCKS = 121  # 120 cacheable blocks and the null block
LAYOUT = "full+swa"


class PerGroup(EvictionPolicy):
    """One ``inner`` policy per KV cache group over a shared pool (measurement only).

    Invariant: every resident key is in the sub-policy of its group; a victim comes from the
    group whose resident keys exceed its even share of ``capacity`` the most.
    """

    name = "pergroup"

    def __init__(self, capacity: int, inner: str, groups: int) -> None:
        super().__init__(capacity)
        self.share = capacity / groups
        self.inner = inner
        # Each sub-policy may grow to the whole pool: the pool, not the split, bounds it.
        self.subs = [make_policy(inner, capacity) for _ in range(groups)]

    def _sub(self, key: Key) -> EvictionPolicy:
        return self.subs[get_group_id(hash_of(key))]  # type: ignore[arg-type]

    def find(self, key: Key) -> bool:
        return self._sub(key).find(key)

    def insert(self, key: Key) -> None:
        self._sub(key).insert(key)

    def to_evict(self) -> Key | None:
        for sub in sorted(self.subs, key=lambda s: len(s) - self.share, reverse=True):
            victim = sub.to_evict()
            if victim is not None:
                return victim
        return None

    def evict(self, key: Key) -> None:
        self._sub(key).evict(key)

    def remove(self, key: Key) -> None:
        self._sub(key).remove(key)

    def pin(self, key: Key) -> None:
        self._sub(key).pin(key)

    def unpin(self, key: Key) -> None:
        self._sub(key).unpin(key)

    def __contains__(self, key: object) -> bool:
        return any(key in sub for sub in self.subs)

    def __len__(self) -> int:
        return sum(len(sub) for sub in self.subs)

    def resident_keys(self) -> Iterator[Key]:
        for sub in self.subs:
            yield from sub.resident_keys()

    def verify(self) -> None:
        for sub in self.subs:
            sub.verify()

    def clear(self) -> None:
        for sub in self.subs:
            sub.clear()


def block_tokens(hash_id: int) -> list[int]:
    rng = random.Random(5 * 1_000_003 + hash_id)
    return [rng.randrange(4, 30_000) for _ in range(BS)]


def replay(policy: str | None, chains: list[list[int]]) -> tuple[float, float, float]:
    """Prompt-token hit rate and the min/max share of cached blocks the second group holds."""
    manager = make_manager(policy, NUM_BLOCKS, BS, layout=LAYOUT)
    pool = manager.block_pool
    hits = queries = 0
    shares = []
    for chain in chains:
        request = make_request([t for h in chain for t in block_tokens(h)] + [1, 2], BS)
        computed, hit_tokens, _ = manager.get_computed_blocks(request)
        new = request.num_tokens - hit_tokens
        assert manager.allocate_slots(request, new, hit_tokens, computed) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        hits += hit_tokens
        queries += request.num_tokens
        groups = [0, 0]
        for block in pool.blocks:
            if block.block_hash is not None:
                groups[get_group_id(block.block_hash)] += 1
        shares.append(groups[1] / sum(groups))
    if policy is not None:
        pool.verify()
    return hits / queries, min(shares), max(shares)


def main() -> None:
    patches.install("lru", on_step=lambda: None, on_pool=lambda pool: None)
    params = DocQAParams(
        documents=40,
        document_tokens=2_500,
        questions_per_document=6.0,
        question_tokens=600,
        output_tokens=1,
        seed=5,
    )
    path = Path("/tmp/arc-evictor-measure-groups.jsonl")
    write_generated(path, docqa(params), "mooncake")
    chains = [list(r.hash_ids[: r.num_blocks]) for r in load_trace(path) if r.num_blocks]
    print(f"{len(chains)} requests, layout {LAYOUT}, {NUM_BLOCKS - 1} blocks")
    print("pool                      hit rate  swa share min..max")
    rows: list[tuple[str, str | None]] = [("vLLM's own", None)]
    for inner in ("lru", "arc", "s3fifo"):
        REGISTRY[f"pergroup-{inner}"] = lambda c, inner=inner: PerGroup(c, inner, 2)
        rows += [(f"one {inner} policy", inner), (f"{inner} per group", f"pergroup-{inner}")]
    for label, policy in rows:
        rate, low, high = replay(policy, chains)
        print(f"{label:<25} {rate:8.3f}  {low:.2f}..{high:.2f}")


if __name__ == "__main__":
    main()
