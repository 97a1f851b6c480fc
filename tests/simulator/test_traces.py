"""Trace readers: both forms, chain re-keying, and clear errors with line numbers."""

from __future__ import annotations

import gc
import json

import pytest

from arc_serving_common.traces import TraceError, load_trace, read_trace
from arc_simulator import MOONCAKE_SAMPLE
from tests.simulator.builders import bailian, mooncake


def test_mooncake_ids_are_the_keys_and_timestamps_become_seconds(write_lines) -> None:
    path = write_lines([mooncake(0, [1, 2, 3]), mooncake(1500, [1, 2, 4])])
    first, second = load_trace(path)
    assert first.keys == (1, 2, 3) and second.keys == (1, 2, 4)
    assert second.timestamp_s == 1.5
    assert first.block_tokens == 512


def test_partial_last_block_is_not_a_cache_key(write_lines) -> None:
    (request,) = load_trace(write_lines([mooncake(0, [7, 8, 9], tail=100)]))
    assert request.hash_ids == (7, 8, 9)
    assert request.keys == (7, 8)
    assert request.max_hit_blocks == 2


def test_full_prompt_leaves_its_last_block_to_compute(write_lines) -> None:
    (request,) = load_trace(write_lines([mooncake(0, [7, 8, 9])]))
    assert request.keys == (7, 8, 9)
    assert request.max_hit_blocks == 2  # vLLM always computes the last prompt token


def test_bailian_ids_are_rekeyed_by_chain(write_lines) -> None:
    # Block id 5 follows different prefixes, so it must give different keys.
    path = write_lines(
        [bailian(1, -1, 0.0, [1, 5]), bailian(2, -1, 1.0, [2, 5]), bailian(3, 1, 2.0, [1, 5, 6])]
    )
    one, two, three = load_trace(path)
    assert one.keys[1] != two.keys[1]
    assert three.keys[:2] == one.keys
    assert three.parent_id == 1 and one.parent_id is None and three.chat_id == 3
    assert one.block_tokens == 16


def plain_chain_keys(chains: list[list[int]]) -> list[tuple[int, ...]]:
    """Each chain's keys interned block by block from the start, first seen first."""
    ids: dict[tuple[int, int], int] = {}
    found = []
    for chain in chains:
        keys, previous = [], -1
        for block_id in chain:
            previous = ids.setdefault((previous, block_id), len(ids))
            keys.append(previous)
        found.append(tuple(keys))
    return found


def test_bailian_keys_do_not_depend_on_the_parent_a_turn_names(write_lines) -> None:
    # Turns that extend their parent, diverge from it, repeat it, name an unknown or a
    # reused chat id: the keys are those of interning every chain from its first block.
    lines = [
        (1, -1, [1, 2, 3]),
        (2, 1, [1, 2, 3, 4, 5]),
        (3, 1, [1, 9, 3, 4]),  # diverges inside the parent's blocks
        (4, 2, [1, 2]),  # shorter than its parent
        (5, 77, [1, 2, 3, 4, 5, 6]),  # a parent the trace never had
        (2, 4, [1, 2, 7]),  # chat id 2 again, now another chain
        (6, 2, [1, 2, 7, 8]),
        (7, 2, [1, 2, 3, 4, 5, 6]),  # extends the first chat 2, not the second
    ]
    path = write_lines(
        [bailian(chat, parent, float(t), ids) for t, (chat, parent, ids) in enumerate(lines)]
    )
    read = [request.keys for request in load_trace(path)]
    assert read == plain_chain_keys([ids for _, _, ids in lines])


def test_format_is_detected_from_the_first_line(write_lines) -> None:
    assert load_trace(write_lines([bailian(1, -1, 0.0, [1])]))[0].chat_id == 1
    with pytest.raises(TraceError, match=":1: a bailian line in a mooncake trace"):
        load_trace(write_lines([bailian(1, -1, 0.0, [1])]), "mooncake")


def test_first_line_in_neither_form_is_an_error(write_lines) -> None:
    with pytest.raises(TraceError, match=":1: neither Mooncake nor Qwen-Bailian"):
        load_trace(write_lines([{"timestamp": 0}]))


def test_blank_lines_are_skipped(write_lines) -> None:
    assert len(load_trace(write_lines(["", mooncake(0, [1]), "   "]))) == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        (  # only a byte-order mark opening the file is skipped
            '\ufeff{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            r"not valid JSON \(Unexpected UTF-8 BOM",
        ),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        (json.dumps(bailian(1, -1, 0.0, [1])), "a bailian line in a mooncake trace"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "missing field 'input_length'"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}',
            "hash_ids",
        ),
        (
            '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "'timestamp' must be >= 0",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": true, "hash_ids": [1]}',
            "'output_length' must be an integer",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            "expected 2 blocks",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "'input_length' must be >= 1",
        ),
        (
            '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [4, 4]}',
            "hash id 4 repeats at block 2",
        ),
    ],
)
def test_malformed_line_names_file_line_and_problem(write_lines, line: str, problem: str) -> None:
    path = write_lines([mooncake(0, [1]), line])
    with pytest.raises(TraceError, match=problem) as caught:
        load_trace(path)
    assert str(caught.value).startswith(f"{path}:2: ")
    assert caught.value.line == 2


def test_malformed_bailian_parent_is_rejected(write_lines) -> None:
    path = write_lines([bailian(1, -5, 0.0, [1])])
    with pytest.raises(TraceError, match=r":1: field 'parent_chat_id'"):
        load_trace(path)


def test_timestamps_going_back_are_rejected(write_lines) -> None:
    path = write_lines([mooncake(2000, [1]), mooncake(1000, [2])])
    with pytest.raises(TraceError, match=r":2: timestamp goes back"):
        load_trace(path)


def test_reader_yields_nothing_past_a_bad_line(write_lines) -> None:
    path = write_lines([mooncake(0, [1]), "oops", mooncake(1, [2])])
    seen = []
    with pytest.raises(TraceError):
        for request in read_trace(path):
            seen.append(request.index)
    assert seen == [0]


def test_empty_trace_is_an_error(write_lines) -> None:
    with pytest.raises(TraceError, match="holds no requests"):
        load_trace(write_lines([""]))


def test_missing_file_is_an_error(tmp_path) -> None:
    with pytest.raises(TraceError, match="cannot open trace"):
        load_trace(tmp_path / "absent.jsonl")


def test_unknown_format_name_lists_the_valid_ones(write_lines) -> None:
    with pytest.raises(TraceError, match="valid: auto, mooncake, bailian"):
        load_trace(write_lines([mooncake(0, [1])]), "csv")


@pytest.mark.parametrize("collecting", [True, False])
@pytest.mark.parametrize("readable", [True, False])
def test_loading_leaves_the_garbage_collector_as_it_found_it(
    write_lines, collecting: bool, readable: bool
) -> None:
    """load_trace pauses the collector while it reads, and gives it back as it was, also
    when the trace is refused."""
    lines = [mooncake(0, [1])] if readable else [mooncake(0, [1]), "oops"]
    path = write_lines(lines)
    was = gc.isenabled()
    (gc.enable if collecting else gc.disable)()
    try:
        if readable:
            assert len(load_trace(path)) == 1
        else:
            with pytest.raises(TraceError, match=":2: "):
                load_trace(path)
        assert gc.isenabled() is collecting
    finally:
        (gc.enable if was else gc.disable)()


def test_sample_trace_in_the_repo_reads_whole() -> None:
    requests = load_trace(MOONCAKE_SAMPLE)
    assert len(requests) == 3993
    assert sum(len(r.hash_ids) for r in requests) == 121_877
