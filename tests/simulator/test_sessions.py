"""Session keys of unlinked (Mooncake) traces held to the generator's truth
(arc_serving_common.sessions, arc_simulator.session_check)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from arc_serving_common.sessions import CROWDED_SESSION_SHARE, session_keys
from arc_serving_common.traces import load_trace
from arc_simulator import MOONCAKE_SAMPLE
from arc_simulator.cli import main
from arc_simulator.generate import ConversationParams, conversation, write_generated
from arc_simulator.session_check import check_trace
from tests.simulator.builders import mooncake

SYSTEM = 1  # the system prompt: one block every conversation opens with


def _keys(write_lines, records: list[dict]) -> list[str]:
    return session_keys(load_trace(write_lines(records)))


def _groups(keys: list[str], names: list[str]) -> set[frozenset[str]]:
    """The requests (by name) each key puts together."""
    groups: dict[str, set[str]] = {}
    for key, name in zip(keys, names, strict=True):
        groups.setdefault(key, set()).add(name)
    return {frozenset(group) for group in groups.values()}


# Conversation a's first turn is the system prompt and a question shorter than a block; b, c
# and d open with the same block and go on each its own way; b and c have later turns.
REQUESTS = {
    "a1": mooncake(0, [SYSTEM, 100], tail=200),
    "b1": mooncake(0, [SYSTEM, 20, 101], tail=100),
    "b2": mooncake(0, [SYSTEM, 20, 21, 22, 102], tail=100),
    "c1": mooncake(0, [SYSTEM, 30, 103], tail=50),
    "c2": mooncake(0, [SYSTEM, 30, 31, 104], tail=50),
    "d1": mooncake(0, [SYSTEM, 40, 41, 105], tail=50),
}
# The order of a conversation's turns is fixed; any other interleaving is possible.
ORDERS = [
    order
    for order in itertools.permutations(REQUESTS)
    if order.index("b1") < order.index("b2") and order.index("c1") < order.index("c2")
]


@pytest.mark.parametrize("order", [*ORDERS[:: max(1, len(ORDERS) // 24)], ORDERS[-1]])
def test_a_shared_opening_joins_no_conversations_whatever_the_order(write_lines, order) -> None:
    keys = _keys(write_lines, [REQUESTS[name] for name in order])
    assert _groups(keys, list(order)) == {
        frozenset({"a1"}), frozenset({"b1", "b2"}), frozenset({"c1", "c2"}), frozenset({"d1"})
    }  # fmt: skip


def test_a_conversations_turns_share_a_key_named_after_its_first_line(write_lines) -> None:
    records = [REQUESTS[name] for name in ("b1", "a1", "c1", "b2", "c2")]
    assert _keys(write_lines, records) == ["line:1", "line:2", "line:3", "line:1", "line:3"]


def test_requests_ending_where_no_conversation_parts_are_one_session(write_lines) -> None:
    # The same prompt twice, and a turn that adds less than a block: nothing tells these apart
    # from one conversation, so they stay together (the module's "What the blocks cannot tell").
    records = [
        mooncake(0, [SYSTEM, 50, 60], tail=10),
        mooncake(0, [SYSTEM, 50, 60], tail=10),
        mooncake(0, [SYSTEM, 50, 61], tail=300),
        mooncake(0, [SYSTEM, 52, 53], tail=30),
    ]
    assert _keys(write_lines, records) == ["line:1", "line:1", "line:1", "line:4"]


def test_a_request_without_a_full_block_opens_a_conversation(write_lines) -> None:
    records = [mooncake(0, [60], tail=100), mooncake(0, [60], tail=100)]
    assert _keys(write_lines, records) == ["line:1", "line:2"]


def test_linked_traces_keep_their_root_chat_ids(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    write_generated(path, conversation(ConversationParams(sessions=40, seed=3)), "bailian")
    requests = load_trace(path)
    roots = {}
    for request in requests:
        roots[request.chat_id] = roots.get(request.parent_id, request.chat_id)
    assert session_keys(requests) == [f"chat:{roots[request.chat_id]}" for request in requests]


def _generated(tmp_path: Path, **params) -> Path:
    path = tmp_path / "conversations.jsonl"
    write_generated(path, conversation(ConversationParams(**params)), "mooncake")
    return path


# Every conversation opens with one of a few system prompts of exactly one Mooncake block,
# its turns spread among thousands of others' (a think time of 5 minutes at 4 new
# conversations a second).
SHAPE = {"system_tokens": 512, "sessions_per_second": 4.0, "think_time_s": 300.0}
GENERATED = pytest.mark.parametrize(
    ("sessions", "system_prompts", "seed"),
    list(itertools.product([10, 300, 5000], [1, 8], [0, 1, 2])),
)


@GENERATED
def test_keys_equal_the_truth_when_every_first_turn_goes_past_the_opening(
    tmp_path: Path, seed: int, system_prompts: int, sessions: int
) -> None:
    # First questions of 563 to 1,688 tokens: every first turn has a block of its own.
    path = _generated(
        tmp_path, sessions=sessions, system_prompts=system_prompts, first_user_tokens=1125,
        seed=seed, **SHAPE,
    )  # fmt: skip
    report = check_trace(path)
    assert report.true_sessions == sessions
    assert (report.wrongly_together, report.wrongly_apart, report.keys) == (0, 0, sessions)


@GENERATED
def test_only_prompts_other_conversations_share_are_placed_wrong_and_they_are_rare(
    tmp_path: Path, seed: int, system_prompts: int, sessions: int
) -> None:
    # First questions of 500 to 1,500 tokens (1.2% of them shorter than a block: those first
    # turns are the system prompt and a partial block), and 2% of the conversations open with
    # one of 20 popular questions, word for word.
    path = _generated(
        tmp_path, sessions=sessions, system_prompts=system_prompts, first_user_tokens=1000,
        popular_first_share=0.02, seed=seed, **SHAPE,
    )  # fmt: skip
    report = check_trace(path)
    assert report.unexplained_pairs == 0
    assert report.exception_share is not None and report.exception_share < 0.01
    assert report.largest_share <= 0.02 or report.largest_key_requests <= 12  # one conversation


def test_the_generated_case_made_one_session_of_the_trace_under_a_longest_prefix_rule(
    tmp_path: Path,
) -> None:
    # The rule this module replaced (an earlier request's whole run of full blocks that is a
    # prefix of the request's own continues it) on the shape above: one key held nearly all.
    path = _generated(tmp_path, sessions=3000, system_prompts=1, first_user_tokens=1000,
                      seed=1, **SHAPE)  # fmt: skip
    requests = load_trace(path)
    ends: dict[int, str] = {}
    keys = []
    for request in requests:
        key = next((ends[k] for k in reversed(request.keys) if k in ends), None)
        key = key or f"line:{request.line}"
        ends[request.keys[-1]] = key
        keys.append(key)
    largest = max(keys.count(key) for key in set(keys))
    assert largest > 0.9 * len(requests)
    assert check_trace(path).largest_share < 0.01


def test_no_key_of_the_public_mooncake_sample_holds_more_than_two_percent() -> None:
    report = check_trace(MOONCAKE_SAMPLE)
    assert report.requests == 3993
    assert report.largest_share <= 0.02
    assert report.true_sessions is None


def test_the_sessions_command_prints_the_keys_against_the_truth(tmp_path: Path, capsys) -> None:
    path = _generated(tmp_path, sessions=50, system_prompts=2, first_user_tokens=1125, **SHAPE)
    assert main(["sessions", str(path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["true_sessions"], row["keys"], row["exception_requests"]) == (50, 50, 0)
    assert main(["sessions", str(path)]) == 0
    assert "truth: 50 conversations; pairs wrongly together 0, wrongly apart 0" in (
        capsys.readouterr().out
    )


def test_the_simulator_warns_naming_the_trace_when_one_session_holds_a_quarter(
    write_lines, capsys
) -> None:
    # One conversation of 40 turns beside 60 one-turn conversations: 40% of the requests.
    records = [
        mooncake(n, [SYSTEM, 500, *range(1000, 1000 + n), 9000 + n], tail=10) for n in range(40)
    ]
    records += [mooncake(40 + n, [SYSTEM, 2000 + n, 8000 + n], tail=10) for n in range(60)]
    trace = write_lines(records, "crowded.jsonl")
    args = ["simulate", str(trace), "--policy", "lru", "--capacity", "50", "--replicas", "2"]
    assert main([*args, "--router", "consistent_hash"]) == 0
    warning = capsys.readouterr().err
    assert f"{trace}: session line:1 holds 40 of the trace's 100 requests (40%)" in warning
    assert CROWDED_SESSION_SHARE == 0.25
    assert main([*args, "--router", "round_robin"]) == 0  # keys no session: no warning
    assert "session" not in capsys.readouterr().err


def test_a_bad_true_session_is_refused_naming_its_line(write_lines, capsys) -> None:
    records = [{**mooncake(0, [SYSTEM, 70], tail=10), "true_session": 1}]
    records.append({**mooncake(1, [SYSTEM, 71], tail=10), "true_session": "two"})
    trace = write_lines(records, "truth.jsonl")
    assert main(["sessions", str(trace)]) == 2
    error = capsys.readouterr().err
    assert f"{trace}:2: field 'true_session' must be an integer, got 'two'" in error
