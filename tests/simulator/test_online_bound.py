"""Issue 7's gap target on the generated conversations is beyond any online policy.

The generator's sessions are memoryless (geometric turn counts, exponential think times), so
the chance that an idle session comes back only falls with its idle time: recency is the best
online order for a session's blocks (apart from the 4% of sessions that reach the turn cap;
README: a policy told those too still falls short). The only blocks worth more than their
recency are the shared system prompts. So the best online policy, told which blocks are the
prompts, is LRU that never evicts a prompt block while anything else can go. On the
evaluation's own conversation traces it closes less than a quarter of the gap from max(LRU,
ARC) to Belady at the two smallest capacities: Belady's lead there is knowing which sessions
end. If this test fails, the generator has changed and the target may be within reach (README,
"Which policy to use").
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest

from arc_evictor.policies.base import Key
from arc_evictor.policies.lru import LRU
from arc_serving_common.traces import BLOCK_TOKENS, load_trace
from arc_simulator.evaluate import GAP_SHARE, EvaluationConfig, make_row
from arc_simulator.generate import conversation, write_generated
from arc_simulator.simulate import simulate, simulate_overlapping, simulate_sequential

EVALUATION = EvaluationConfig()


class PromptPinningLRU(LRU):
    """LRU that evicts a prompt block only when no other block is evictable."""

    def __init__(self, capacity: int, prompts: set[Key]) -> None:
        super().__init__(capacity)
        self._prompts = prompts

    def to_evict(self) -> Key | None:
        return next((key for key in self._order if key not in self._prompts), super().to_evict())


@pytest.mark.parametrize("seed", EVALUATION.seeds)
def test_prompt_pinning_lru_closes_under_a_quarter_of_the_gap(seed: int, tmp_path: Path) -> None:
    params = dataclasses.replace(EVALUATION.conversation, seed=seed)
    path = tmp_path / "conversation.jsonl"
    write_generated(path, conversation(params), "bailian")
    requests = load_trace(path)
    uses = collections.Counter(key for request in requests for key in request.keys)
    # A session's block is used at most once a turn; only the shared prompts are used more.
    prompts = {key for key, count in uses.items() if count > params.max_turns}
    assert len(prompts) == params.system_prompts * (params.system_tokens // BLOCK_TOKENS["bailian"])
    for percent in sorted(EVALUATION.capacity_percents)[:2]:
        capacity = round(len(uses) * percent / 100)
        for mode in EVALUATION.modes:
            sequential = mode == "sequential"
            results = [
                simulate(requests, name, capacity, sequential=sequential)
                for name in ("lru", "arc", "belady")
            ]
            replay = simulate_sequential if sequential else simulate_overlapping
            pinning = replay(requests, PromptPinningLRU(capacity, prompts))
            pinning.policy = "prompt-pinning"  # describe() says "lru"
            # The evaluation's own arithmetic, as issue 7's targets are judged.
            row = make_row("conversation", mode, percent, [*results, pinning], pinning.policy, True)
            where = f"seed {seed}, {percent:g}%, {mode}"
            # A strong online policy (above both), and still short of the target.
            assert row.margin >= 0, f"{where}: {row.margin:+.4f} below max(LRU, ARC)"
            assert row.gap_closed is not None and row.gap_closed < GAP_SHARE, (
                f"{where}: prompt-pinning LRU closes {row.gap_closed:.1%}"
            )
