"""An online bound for the generated conversation traces: prompt-pinning LRU.

The conversation generator's sessions are memoryless (geometric turn counts, exponential think
times), so the chance that an idle session comes back only falls with its idle time: recency is
the best online order for a session's blocks. The only blocks worth more than their recency are
the shared system prompts. The best online policy that knows this is LRU that never evicts a
prompt block while anything else can go. The evaluation reports its hit rate next to Belady's:
the part of Belady's lead it does not reach is knowing which sessions end, which no online
policy knows.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from arc_evictor.policies.base import Key
from arc_evictor.policies.lru import LRU
from arc_serving_common.traces import TraceRequest


def prompt_blocks(requests: Sequence[TraceRequest], max_turns: int) -> frozenset[Key]:
    """The blocks used more than ``max_turns`` times.

    A session's own blocks are used at most once a turn, so only shared system prompts can be
    used more often; a prompt that few sessions drew may fall under the cut and count as a
    session's block (the evaluation's 300 sessions find all 8 prompts).
    """
    uses = collections.Counter(key for request in requests for key in request.keys)
    return frozenset(key for key, count in uses.items() if count > max_turns)


class PromptPinningLRU(LRU):
    """LRU that evicts a prompt block only when no other block is evictable.

    Invariant: LRU's, and ``to_evict`` names a non-prompt key whenever one is unpinned.
    """

    name = "prompt-pinning-lru"

    def __init__(self, capacity: int, prompts: frozenset[Key]) -> None:
        super().__init__(capacity)
        self._prompts = prompts

    def to_evict(self) -> Key | None:
        return next((key for key in self._order if key not in self._prompts), super().to_evict())
