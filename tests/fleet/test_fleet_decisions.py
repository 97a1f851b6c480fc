"""Joining one replay's records into decisions (``arc_dev.fleet_decisions``), and recording
vLLM's KV events as a router receives them (``arc_harness.kv_events``) from vLLM's own ZMQ
publisher."""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from arc_dev.fleet_decisions import (
    BOUNDARY_S,
    Decision,
    DecisionRecordError,
    State,
    boundary_s,
    cache_aware_placement,
    join_decisions,
    read_decisions,
    summarise,
    unanchored_stores,
    write_decisions,
)
from arc_harness.kv_events import KvBatch, KvEvent, KvEventRecorder, read_batches, write_batches
from arc_serving_common.traces import TraceRequest

BLOCK = 4
URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2")
T0 = 1000.0
# Prompts of the three requests: B shares A's first two blocks, C shares nothing.
PROMPTS = {
    0: [1, 1, 1, 1, 2, 2, 2, 2, 3],
    1: [1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5, 5, 6],
    2: [7, 7, 7, 7, 8],
}


def _request(index: int) -> TraceRequest:
    length = len(PROMPTS[index])
    return TraceRequest(index, index + 1, float(index), length, 4, (index,), (index,), BLOCK)


def _row(index: int, sent: float, ttft: float, e2e: float) -> dict[str, Any]:
    return {
        "index": index, "ok": True, "sent_wall": T0 + sent, "ttft_s": ttft, "e2e_s": e2e,
        "input_tokens": len(PROMPTS[index]), "cached_tokens": None,
    }  # fmt: skip


def _log_line(worker: str, prompt: int, new: int) -> str:
    # As vllm-router 0.1.17 prints it, colours included.
    return (
        "\x1b[2m2026-12-05 22:01:20\x1b[0m \x1b[34mDEBUG\x1b[0m src/policies/kv_aware.rs:1314: "
        'KV prefix decision \x1b[3moutcome\x1b[0m\x1b[2m=\x1b[0m"prefix_cost" '
        f'\x1b[3mworker\x1b[0m\x1b[2m=\x1b[0m"{worker}" \x1b[3minput_tokens\x1b[0m=\x1b[0m{prompt} '
        f"new_prefill_tokens={new} credited_prefix_tokens={prompt - new} used_binding=false"
    )


def _stored(server: int, at: float, hashes: list[str], parent: str | None, tokens: list[int]):
    # Received 0.7 s after vLLM stamped it (after B was sent): the join goes by the stamp.
    return KvBatch(server, T0 + at, T0 + at + 0.7, 0, (KvEvent("BlockStored", tuple(hashes),
                                                              parent, tuple(tokens)),))  # fmt: skip


# A on server 0 stores its two blocks at 0.5 s; B (1 s) finds them there while A still decodes
# (load 1, prefill done), and goes to server 0; C (1.02 s) is cold: server 1 is idle.
ROWS = [_row(0, 0.0, 0.3, 1.5), _row(1, 1.0, 0.1, 0.2), _row(2, 1.02, 0.1, 0.2)]
BATCHES = [
    _stored(0, 0.5, ["a1", "a2"], None, PROMPTS[0][:8]),
    _stored(0, 1.2, ["b3"], "a2", PROMPTS[1][8:12]),
    KvBatch(1, T0 + 0.1, T0 + 0.8, 0, (KvEvent("AllBlocksCleared"),)),
]
LOG = "\n".join(
    [
        _log_line(URLS[0], 9, 9),
        'x KV prefix decision outcome="missing_tokens" worker="u" input_tokens=0',  # a probe
        _log_line(URLS[1], 5, 5),  # C reached the router before B
        _log_line(URLS[0], 13, 5),
    ]
)


def _join(
    rows: list[dict[str, Any]] = ROWS, log: str = LOG, batches: Sequence[KvBatch] = BATCHES
) -> list[Decision]:
    return join_decisions(
        [_request(i) for i in PROMPTS],
        lambda request: PROMPTS[request.index],
        rows, log, batches, URLS, BLOCK,
    )  # fmt: skip


def _received_after(lag_s: float) -> list[KvBatch]:
    """BATCHES as a recorder that received each ``lag_s`` after vLLM's stamp."""
    return [replace(batch, received=batch.published + lag_s) for batch in BATCHES]


def test_each_request_meets_the_state_it_was_sent_into() -> None:
    first, second, third = _join()
    assert (first.index, first.worker, first.state) == (0, 0, State([0, 0], [0, 0], [0, 0]))
    # B: server 0 holds 8 of its 13 tokens and runs A (prefill over): 5 x 2 = 10 against 13.
    assert second.index == 1 and second.worker == 0
    assert second.state == State([8, 0], [1, 0], [0, 0])
    assert second.rule() == [0] and second.agrees() and second.credit_matches
    # C reached the router before B in its log: matched by prompt length, not by log order.
    assert (third.index, third.worker, third.router_new_tokens) == (2, 1, 5)
    assert third.state.loads == [2, 0] and third.rule() == [1]
    assert all(decision.explained() for decision in (first, second, third))


def test_a_decision_is_explained_by_any_state_within_the_window() -> None:
    # B sent 40 ms before A's blocks were published: the stamp's state credits nothing, the
    # window's later state credits what the router credited.
    prompt = _received_after(0.005)
    assert boundary_s(prompt) == BOUNDARY_S
    rows = [_row(0, 0.0, 0.3, 1.5), _row(1, 0.5 - 0.04, 0.1, 0.2), _row(2, 1.02, 0.1, 0.2)]
    _, early, _ = _join(rows, batches=prompt)
    assert BOUNDARY_S > 0.04
    assert early.state.published_tokens == [0, 0] and not early.credit_matches
    assert State([8, 0], [1, 0], [0, 0]) in early.window
    assert early.explained()
    # Outside the window nothing explains it.
    rows[1] = _row(1, 0.5 - 2 * BOUNDARY_S, 0.1, 0.2)
    assert not _join(rows, batches=prompt)[1].explained()


def test_the_window_widens_to_the_lag_the_recording_measured() -> None:
    # B sent 150 ms before A's blocks were stamped published, as a router that fell behind its
    # publishers credits them: unexplained where batches arrived at once, explained where the
    # recorder itself received them 200 ms late.
    rows = [_row(0, 0.0, 0.3, 1.5), _row(1, 0.5 - 0.15, 0.1, 0.2), _row(2, 1.02, 0.1, 0.2)]
    assert not _join(rows, batches=_received_after(0.005))[1].explained()
    lagging = _received_after(0.2)
    assert boundary_s(lagging) == pytest.approx(0.2)
    assert _join(rows, batches=lagging)[1].explained()
    # Nine batches in ten: one late batch does not widen it.
    one_late = [*_received_after(0.005) * 3, replace(BATCHES[0], received=BATCHES[0].published + 5)]
    assert boundary_s(one_late) == BOUNDARY_S


def test_the_rule_is_the_one_given() -> None:
    third = _join(batches=_received_after(0.005))[2]

    def prefix_only(new: int, in_flight: int, load: int) -> int:
        return new

    # Without the load term the cold prompt ties: the busy server 0 would do as well.
    assert third.rule(prefix_only) == [0, 1]

    def busiest_first(new: int, in_flight: int, load: int) -> int:
        return -load

    assert third.rule(busiest_first) == [0] and not third.explained(busiest_first)


def test_records_that_do_not_join_are_refused_naming_the_request() -> None:
    with pytest.raises(DecisionRecordError, match="no router decision for request 2"):
        _join(log="\n".join([_log_line(URLS[0], 9, 9), _log_line(URLS[0], 13, 5)]))
    with pytest.raises(DecisionRecordError, match="not a server"):
        _join(log=LOG.replace(URLS[1], "http://elsewhere:1"))


def _cache_line(worker: str) -> str:
    # As vllm-router 0.1.17 prints its cache_aware choice at debug level, colours included.
    return (
        "\x1b[2m2026-12-06 23:40:02\x1b[0m \x1b[34mDEBUG\x1b[0m src/policies/cache_aware.rs:384: "
        'Cache prefix decision \x1b[3mstage\x1b[0m\x1b[2m=\x1b[0m"route" '
        f'\x1b[3mselected\x1b[0m\x1b[2m=\x1b[0m"{worker}" match_rate=0.5 batch_prompts=1'
    )


def test_a_cache_aware_placement_is_read_in_sending_order() -> None:
    log = "\n".join(
        ["INFO unrelated", _cache_line(URLS[1]), _cache_line(URLS[0]), _cache_line(URLS[1])]
    )
    rows = [ROWS[2], ROWS[0], ROWS[1]]  # rows come in answering order, not sending order
    assert cache_aware_placement(rows, log, URLS) == {0: 1, 1: 0, 2: 1}
    with pytest.raises(DecisionRecordError, match="logged 2 cache_aware decisions for 3"):
        cache_aware_placement(rows, "\n".join([_cache_line(URLS[0])] * 2), URLS)
    with pytest.raises(DecisionRecordError, match=re.escape("'http://127.0.0.1:9', not a server")):
        cache_aware_placement(rows, "\n".join([_cache_line("http://127.0.0.1:9")] * 3), URLS)


def test_decisions_and_batches_read_back_as_written(tmp_path: Path) -> None:
    decisions = _join()
    write_decisions(tmp_path / "decisions.jsonl", decisions)
    assert read_decisions(tmp_path / "decisions.jsonl") == decisions
    write_batches(tmp_path / "kv_events.jsonl", BATCHES)
    assert read_batches(tmp_path / "kv_events.jsonl") == BATCHES
    summary = summarise(decisions)
    assert summary["decisions"] == 3 and summary["explained"] == 3
    assert summary["credited_tokens"] == 8 and summary["sent_away"] == 0


def test_a_store_after_a_parent_never_stored_is_counted() -> None:
    assert unanchored_stores(BATCHES) == 0
    orphan = _stored(1, 2.0, ["c2"], "c1", PROMPTS[2][:4])
    assert unanchored_stores([*BATCHES, orphan]) == 1


@pytest.fixture
def publisher() -> Iterator[tuple[Any, str]]:
    """vLLM's own KV-event publisher on a loopback port."""
    with warnings.catch_warnings():
        # torch (imported by vLLM) still uses torch.jit.script_method; not ours to fix, and
        # pytest turns warnings into errors.
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.script_method` is deprecated",
            category=DeprecationWarning,
        )  # fmt: skip
        from vllm.distributed.kv_events import ZmqEventPublisher

    from arc_harness.fleet import check_ports_free

    port = 27690
    check_ports_free([port])
    endpoint = f"tcp://127.0.0.1:{port}"
    # vLLM binds only an endpoint with "*" or "::"; this IPv4-mapped one binds 127.0.0.1.
    published = ZmqEventPublisher(0, endpoint=f"tcp://[::ffff:127.0.0.1]:{port}")
    yield published, endpoint
    published.shutdown()


@pytest.mark.slow  # importing vLLM takes 20 s
def test_the_recorder_keeps_what_vllms_publisher_sends(publisher: tuple[Any, str]) -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
    )

    published, endpoint = publisher
    stored = BlockStored(
        block_hashes=[11, 12], parent_block_hash=10, token_ids=list(range(8)), block_size=4,
        lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    stamps = [time.time() - 2, time.time() - 1]
    with KvEventRecorder([endpoint]) as recorder:
        published.publish(EventBatch(ts=stamps[0], events=[stored]))
        published.publish(
            EventBatch(
                ts=stamps[1],
                events=[BlockRemoved(block_hashes=[b"\x01\x02"], medium="GPU"), AllBlocksCleared()],
            )
        )
    first, second = recorder.snapshot()
    assert (first.server, first.seq, second.seq) == (0, 0, 1)
    assert first.events == (KvEvent("BlockStored", ("11", "12"), "10", tuple(range(8))),)
    assert second.events == (KvEvent("BlockRemoved", ("0102",)), KvEvent("AllBlocksCleared"))
    assert [first.published, second.published] == stamps
    assert stamps[1] < first.received <= second.received
