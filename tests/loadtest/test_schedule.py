"""Open-loop scheduling, session ordering and the worker partition."""

from __future__ import annotations

import time
from pathlib import Path

import gevent
import gevent.event
import pytest
from conftest import conversation_records, write_lines

from arc_loadtest.schedule import Dispatcher, DispatchTiming, PlannedRequest, partition, plan_replay
from arc_serving_common.traces import TraceError, TraceRequest, load_trace


def make_request(index: int, timestamp_s: float, chat_id: int | None = None,
                 parent_id: int | None = None) -> TraceRequest:  # fmt: skip
    return TraceRequest(
        index=index, line=index + 1, timestamp_s=timestamp_s, input_length=16,
        output_length=1, hash_ids=(index,), keys=(index,), block_tokens=16,
        chat_id=chat_id, parent_id=parent_id,
    )  # fmt: skip


def test_due_times_are_trace_offsets_scaled() -> None:
    plan = plan_replay([make_request(0, 10.0), make_request(1, 12.0)], time_scale=0.25)
    assert [p.due_s for p in plan] == [0.0, 0.5]


def test_turns_link_to_their_parent_and_session_root() -> None:
    requests = [make_request(0, 0, 1), make_request(1, 1, 2), make_request(2, 2, 3, parent_id=1),
                make_request(3, 3, 4, parent_id=3)]  # fmt: skip
    plan = plan_replay(requests, 1.0)
    assert [(p.parent, p.session) for p in plan] == [(None, 0), (None, 1), (0, 0), (2, 0)]


def test_parent_outside_the_trace_gates_nothing() -> None:
    plan = plan_replay([make_request(0, 0, 5, parent_id=99)], 1.0)
    assert plan[0].parent is None


def test_session_id_is_the_conversations_root_chat_id() -> None:
    requests = [make_request(0, 0, 7), make_request(1, 1, 8), make_request(2, 2, 9, parent_id=7),
                make_request(3, 3, 10, parent_id=9)]  # fmt: skip
    assert [p.session_id for p in plan_replay(requests, 1.0)] == [
        "chat:7", "chat:8", "chat:7", "chat:7"
    ]  # fmt: skip


def test_session_id_follows_a_parent_outside_the_trace() -> None:
    # A cut sample: chat 5's parent 99 is missing, yet 5 and its reply 6 stay one session.
    requests = [make_request(0, 0, 5, parent_id=99), make_request(1, 1, 6, parent_id=5)]
    assert [p.session_id for p in plan_replay(requests, 1.0)] == ["chat:99", "chat:99"]


def test_mooncake_session_id_follows_the_conversations_chain_of_blocks(tmp_path: Path) -> None:
    # Two conversations open with the same system-prompt block 3; each later turn repeats its
    # conversation's earlier prompt (full blocks) and adds to it. The last request has no full
    # block and opens a conversation of its own.
    records = [
        {"timestamp": 0, "input_length": 70, "output_length": 1, "hash_ids": [3, 4, 5]},
        {"timestamp": 1, "input_length": 70, "output_length": 1, "hash_ids": [3, 6, 7]},
        {"timestamp": 2, "input_length": 100, "output_length": 1, "hash_ids": [3, 4, 8, 9]},
        {"timestamp": 3, "input_length": 130, "output_length": 1, "hash_ids": [3, 6, 10, 11, 12]},
        {"timestamp": 4, "input_length": 140, "output_length": 1, "hash_ids": [3, 4, 8, 9, 13]},
        {"timestamp": 5, "input_length": 20, "output_length": 1, "hash_ids": [14]},
    ]
    trace = load_trace(write_lines(tmp_path / "m.jsonl", records), block_tokens=32)
    keys = [p.session_id for p in plan_replay(trace, 1.0)]
    assert keys == ["line:1", "line:2", "line:1", "line:2", "line:1", "line:6"]


def test_duplicate_chat_id_names_the_line() -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl:2: chat_id 1 already used on line 1"):
        plan_replay([make_request(0, 0, 1), make_request(1, 1, 1)], 1.0, path="t.jsonl")


def test_parent_after_its_child_names_the_line() -> None:
    with pytest.raises(TraceError, match=r"t\.jsonl:1: parent_chat_id 2 appears after"):
        plan_replay([make_request(0, 0, 1, parent_id=2), make_request(1, 1, 2)], 1.0,
                    path="t.jsonl")  # fmt: skip


def test_bad_time_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        plan_replay([make_request(0, 0)], 0.0)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_partition_sends_every_request_once_and_keeps_sessions_whole(
    tmp_path: Path, parts: int
) -> None:
    trace = write_lines(tmp_path / "t.jsonl", conversation_records(sessions=7, turns=3))
    plan = plan_replay(load_trace(trace, block_tokens=32), 1.0)
    shares = [partition(plan, part, parts) for part in range(parts)]
    indexes = sorted(p.request.index for share in shares for p in share)
    assert indexes == list(range(len(plan)))
    owner = {p.session: n for n, share in enumerate(shares) for p in share}
    assert all(owner[p.session] == n for n, share in enumerate(shares) for p in share)
    assert all(shares)  # 7 sessions are enough for every part to get one


def test_partition_rejects_a_part_out_of_range() -> None:
    with pytest.raises(ValueError, match="part must be in"):
        partition([], 2, 2)


# A bound for a slow, busy machine; every wait ends as soon as what it waits for happens.
WAIT_S = 60.0


def test_open_loop_sends_without_waiting_for_earlier_answers() -> None:
    plan = plan_replay([make_request(i, i * 0.02) for i in range(4)], 1.0)
    events: list[tuple[str, int]] = []
    all_sent = gevent.event.Event()

    def send(planned: PlannedRequest, timing: DispatchTiming) -> None:
        events.append(("sent", planned.request.index))
        if len(events) == len(plan):
            all_sent.set()
        # No answer before every request went out: a dispatcher that waited for answers
        # would send the second only when this wait ran out.
        all_sent.wait(timeout=WAIT_S)
        events.append(("done", planned.request.index))

    dispatcher = Dispatcher(plan, send)
    dispatcher.start()
    assert dispatcher.join(timeout=4 * WAIT_S), "dispatcher did not finish"
    kinds = [kind for kind, _ in events]
    assert kinds == ["sent"] * 4 + ["done"] * 4  # all four in flight before any answer


def test_session_turn_waits_for_its_parent_to_finish() -> None:
    requests = [make_request(0, 0.0, 1), make_request(1, 0.01, 2, parent_id=1),
                make_request(2, 0.02, 3)]  # fmt: skip
    timings: dict[int, DispatchTiming] = {}
    events: list[tuple[str, int]] = []
    other_sent = gevent.event.Event()

    def send(planned: PlannedRequest, timing: DispatchTiming) -> None:
        index = planned.request.index
        timings[index] = timing
        events.append(("sent", index))
        if index == 2:
            other_sent.set()
        if index == 0:
            # Turn 1's answer takes 0.2 s, and comes only after the other session's request
            # went out (or the wait ran out, if it was held).
            other_sent.wait(timeout=WAIT_S)
            gevent.sleep(0.2)
        events.append(("done", index))

    dispatcher = Dispatcher(plan_replay(requests, 1.0), send)
    dispatcher.start()
    assert dispatcher.join(timeout=2 * WAIT_S)
    assert events.index(("sent", 1)) > events.index(("done", 0))  # after turn 1's answer
    assert timings[1].sent_s >= timings[0].sent_s + 0.2
    assert timings[1].held_s > 0.1  # and the wait is reported as hold, not as lag
    assert events.index(("sent", 2)) < events.index(("done", 0))  # the other session is not held


def test_stop_abandons_the_rest_of_the_schedule() -> None:
    sent: list[int] = []
    plan = plan_replay([make_request(0, 0.0), make_request(1, 30.0)], 1.0)
    dispatcher = Dispatcher(plan, lambda p, t: sent.append(p.request.index))
    dispatcher.start()
    deadline = time.monotonic() + WAIT_S
    while not sent:
        assert time.monotonic() < deadline, "the first request was not sent"
        gevent.sleep(0.01)
    dispatcher.stop()
    # The dispatcher has finished: nothing more can be sent.
    assert dispatcher.join(timeout=WAIT_S)
    assert sent == [0] and dispatcher.sent == 1
