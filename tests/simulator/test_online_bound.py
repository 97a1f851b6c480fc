"""The online bound's parts: which blocks are the shared prompts, and prompt-pinning LRU."""

from __future__ import annotations

from pathlib import Path

from arc_serving_common.traces import BLOCK_TOKENS, load_trace
from arc_simulator.generate import ConversationParams, conversation, write_generated
from arc_simulator.online_bound import PromptPinningLRU, prompt_blocks


def test_prompt_blocks_are_exactly_the_system_prompts(tmp_path: Path) -> None:
    params = ConversationParams(sessions=300, seed=3)  # the evaluation's size
    path = tmp_path / "conversation.jsonl"
    write_generated(path, conversation(params), "bailian")
    requests = load_trace(path)
    prompts = prompt_blocks(requests, params.max_turns)
    per_prompt = params.system_tokens // BLOCK_TOKENS["bailian"]
    assert len(prompts) == params.system_prompts * per_prompt
    # Every prompt block is some request's leading block run.
    heads = {key for request in requests for key in request.keys[:per_prompt]}
    assert prompts <= heads


def test_prompt_pinning_lru_evicts_prompts_last() -> None:
    policy = PromptPinningLRU(4, frozenset({"p1", "p2"}))
    for key in ("p1", "a", "p2", "b"):
        policy.insert(key)
        policy.unpin(key)
    assert policy.to_evict() == "a"
    policy.evict("a")
    assert policy.to_evict() == "b"
    policy.evict("b")
    # Only prompts left: the least recently released one goes, as in LRU.
    assert policy.to_evict() == "p1"
