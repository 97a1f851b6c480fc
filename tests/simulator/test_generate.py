"""Workload generators: fixed seeds, both forms, the shapes they promise."""

from __future__ import annotations

from collections import Counter

import pytest

from arc_serving_common.traces import load_trace
from arc_simulator.generate import (
    ConversationParams,
    DocQAParams,
    conversation,
    docqa,
    write_generated,
)

SMALL_DOCQA = DocQAParams(documents=50, document_tokens=600, questions_per_document=8, seed=7)
SMALL_CHAT = ConversationParams(sessions=30, mean_turns=3, system_prompts=3, seed=7)


@pytest.mark.parametrize("form", ["mooncake", "bailian"])
def test_same_seed_writes_the_same_bytes(tmp_path, form) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_generated(first, docqa(SMALL_DOCQA), form)
    write_generated(second, docqa(SMALL_DOCQA), form)
    assert first.read_bytes() == second.read_bytes()


def test_another_seed_gives_another_trace(tmp_path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_generated(first, docqa(SMALL_DOCQA), "bailian")
    write_generated(second, docqa(DocQAParams(**{**_fields(SMALL_DOCQA), "seed": 8})), "bailian")
    assert first.read_bytes() != second.read_bytes()


def _fields(params) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


@pytest.mark.parametrize("form", ["mooncake", "bailian"])
def test_both_forms_give_the_same_prefix_structure(tmp_path, form) -> None:
    # At 16 tokens per id the two forms must agree on which blocks are shared.
    path = tmp_path / f"{form}.jsonl"
    write_generated(path, docqa(SMALL_DOCQA), form, block_tokens=16)
    requests = load_trace(path, block_tokens=16)
    shared = Counter(key for request in requests for key in request.keys)
    assert len(requests) == 400
    assert sum(1 for count in shared.values() if count > 1) > 1000


def test_mooncake_and_bailian_keys_match_block_for_block(tmp_path) -> None:
    paths = {}
    for form in ("mooncake", "bailian"):
        paths[form] = tmp_path / f"{form}.jsonl"
        write_generated(paths[form], docqa(SMALL_DOCQA), form, block_tokens=16)
    moon = load_trace(paths["mooncake"], block_tokens=16)
    bail = load_trace(paths["bailian"], block_tokens=16)
    # Same sharing pattern: two requests share block i in one form exactly when in the other.
    for a, b in [(0, 1), (2, 9), (5, 30)]:
        same_moon = [x == y for x, y in zip(moon[a].keys, moon[b].keys, strict=False)]
        same_bail = [x == y for x, y in zip(bail[a].keys, bail[b].keys, strict=False)]
        assert same_moon == same_bail


def test_documents_are_drawn_with_zipf_skew() -> None:
    requests = docqa(
        DocQAParams(documents=100, questions_per_document=20, zipf_exponent=1.0, seed=1)
    )
    popularity = Counter(request.segments[0][0] for request in requests).most_common()
    top, bottom = popularity[0][1], popularity[-1][1]
    assert top > 20 * bottom


def test_a_conversation_turn_extends_the_previous_turn(tmp_path) -> None:
    path = tmp_path / "chat.jsonl"
    write_generated(path, conversation(SMALL_CHAT), "bailian")
    requests = load_trace(path)
    by_id = {request.chat_id: request for request in requests}
    followups = [request for request in requests if request.parent_id is not None]
    assert followups
    for request in followups:
        parent = by_id[request.parent_id]
        assert request.turn == parent.turn + 1
        assert request.timestamp_s >= parent.timestamp_s
        assert request.hash_ids[: len(parent.hash_ids) - 1] == parent.hash_ids[:-1]


def test_sessions_share_their_system_prompts() -> None:
    requests = conversation(SMALL_CHAT)
    prompts = Counter(request.segments[0][0] for request in requests if request.turn == 1)
    assert len(prompts) <= SMALL_CHAT.system_prompts
    assert max(prompts.values()) > 1


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (DocQAParams(documents=0), "documents must be a finite number > 0"),
        (DocQAParams(zipf_exponent=-1), "zipf_exponent must be a finite number >= 0"),
        (DocQAParams(zipf_exponent=float("nan")), "zipf_exponent must be a finite"),
        (DocQAParams(requests_per_second=0), "requests_per_second must be a finite number > 0"),
        (
            DocQAParams(questions_per_document=float("inf")),
            "questions_per_document must be a finite",
        ),
    ],
)
def test_bad_docqa_parameters_are_rejected(params, problem) -> None:
    with pytest.raises(ValueError, match=problem):
        docqa(params)


def test_bad_conversation_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="think_time_s must be a finite number >= 0"):
        conversation(ConversationParams(think_time_s=-1))


def test_zero_block_tokens_is_rejected_before_the_file_is_touched(tmp_path) -> None:
    target = tmp_path / "x.jsonl"
    target.write_text("keep\n")
    with pytest.raises(ValueError, match="block_tokens must be >= 1"):
        write_generated(target, docqa(SMALL_DOCQA), "bailian", block_tokens=0)
    assert target.read_text() == "keep\n"
