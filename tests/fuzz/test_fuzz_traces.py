"""Fuzz the trace readers (``read_trace``): Mooncake and Qwen-Bailian lines, both explicit
formats and auto-detection.

Properties:
- any file either reads or raises TraceError, nothing else;
- a TraceError names the file and a 1-based line L, and L is the *first* bad line: the file
  cut after line L-1 reads without error, the file cut after line L fails the same way;
- a valid trace read back gives exactly the records written (CRLF endings, blank lines and a
  byte-order mark change nothing);
- one mutated line (a field removed, a wrong type, negative, NaN/inf, huge, a bool, bad UTF-8,
  a duplicate key, a stray BOM) fails at that line, naming the field or the problem.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import count, fuzz_settings
from hypothesis import assume, given
from hypothesis import strategies as st

from arc_serving_common.traces import (
    BLOCK_TOKENS,
    MAX_INT,
    TraceError,
    TraceRequest,
    read_trace,
    trace_record,
)

FORMATS = ("auto", "mooncake", "bailian")


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-traces-") as name:
        yield Path(name)


def outcome(path: Path, fmt: str) -> list[TraceRequest] | TraceError:
    """The requests, or the TraceError; any other exception fails the test."""
    try:
        return list(read_trace(path, fmt))
    except TraceError as error:
        return error


def check_first_bad_line(path: Path, data: bytes, fmt: str) -> list[TraceRequest] | TraceError:
    """Read ``data``; if it fails at line L, lines 1..L-1 alone must read cleanly."""
    path.write_bytes(data)
    result = outcome(path, fmt)
    if isinstance(result, TraceError):
        assert result.line is not None and result.line >= 1, result
        assert str(result).startswith(f"{path}:{result.line}: "), result
        assert result.problem.strip(), result
        lines = data.split(b"\n")
        assert result.line <= len(lines), result
        path.write_bytes(b"\n".join(lines[: result.line - 1]))
        prefix = outcome(path, fmt)
        assert not isinstance(prefix, TraceError), (result, prefix)
        path.write_bytes(b"\n".join(lines[: result.line]))
        again = outcome(path, fmt)
        assert isinstance(again, TraceError) and again.line == result.line, (result, again)
    return result


# --------------------------------------------------------------------------- valid records
small = st.integers(min_value=0, max_value=2_000)


@st.composite
def mooncake_records(draw: st.DrawFn, length: int) -> list[dict[str, Any]]:
    """A valid Mooncake trace: ms timestamps not decreasing, unique ids per request."""
    records = []
    now = draw(st.integers(0, 10**9))
    for _ in range(length):
        now += draw(st.integers(0, 10_000))
        input_length = draw(st.integers(1, 512 * 6))
        blocks = -(-input_length // BLOCK_TOKENS["mooncake"])
        ids = draw(st.lists(small, min_size=blocks, max_size=blocks, unique=True))
        records.append(
            {
                "timestamp": now,
                "input_length": input_length,
                "output_length": draw(small),
                "hash_ids": ids,
            }
        )
    return records


@st.composite
def bailian_records(draw: st.DrawFn, length: int) -> list[dict[str, Any]]:
    """A valid Qwen-Bailian trace: second timestamps (3 decimals) not decreasing."""
    records = []
    now = draw(st.integers(0, 10**6))
    for index in range(length):
        now += draw(st.integers(0, 5_000))
        input_length = draw(st.integers(1, 16 * 12))
        blocks = -(-input_length // BLOCK_TOKENS["bailian"])
        records.append(
            {
                "chat_id": index,
                "parent_chat_id": draw(st.integers(-1, max(-1, index - 1))),
                "timestamp": now / 1000,
                "input_length": input_length,
                "output_length": draw(small),
                "type": draw(st.sampled_from(["text", "image", "search", ""])),
                "turn": draw(st.integers(1, 20)),
                "hash_ids": draw(st.lists(small, min_size=blocks, max_size=blocks)),
            }
        )
    return records


def traces(min_size: int = 1) -> st.SearchStrategy[tuple[str, list[dict[str, Any]]]]:
    def build(form_length: tuple[str, int]) -> st.SearchStrategy[Any]:
        form, length = form_length
        records = mooncake_records(length) if form == "mooncake" else bailian_records(length)
        return st.tuples(st.just(form), records)

    return st.tuples(st.sampled_from(["mooncake", "bailian"]), st.integers(min_size, 6)).flatmap(
        build
    )


def encode(records: list[dict[str, Any]], newline: bytes = b"\n") -> list[bytes]:
    return [json.dumps(record).encode() for record in records]


@given(
    trace=traces(min_size=0),
    explicit=st.booleans(),
    crlf=st.booleans(),
    bom=st.booleans(),
    blanks=st.lists(st.integers(0, 8), max_size=4),
)
@fuzz_settings(2_000)
def test_valid_traces_round_trip(
    folder: Path,
    trace: tuple[str, list[dict[str, Any]]],
    explicit: bool,
    crlf: bool,
    bom: bool,
    blanks: list[int],
) -> None:
    count("traces: valid round trip")
    form, records = trace
    lines = encode(records)
    for position in sorted(blanks, reverse=True):
        lines.insert(min(position, len(lines)), b" \t")
    newline = b"\r\n" if crlf else b"\n"
    data = (b"\xef\xbb\xbf" if bom else b"") + newline.join(lines) + newline
    path = folder / "valid.jsonl"
    path.write_bytes(data)
    requests = list(read_trace(path, form if explicit else "auto"))
    assert [trace_record(request, form) for request in requests] == records  # type: ignore[arg-type]
    assert [request.index for request in requests] == list(range(len(records)))


# ---------------------------------------------------------------------------- random input
@given(data=st.binary(max_size=300), fmt=st.sampled_from(FORMATS))
@fuzz_settings(3_000)
def test_random_bytes_raise_only_trace_errors(folder: Path, data: bytes, fmt: str) -> None:
    count("traces: random bytes")
    check_first_bad_line(folder / "bytes.jsonl", data, fmt)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "timestamp",
                    "input_length",
                    "output_length",
                    "hash_ids",
                    "chat_id",
                    "parent_chat_id",
                    "type",
                    "turn",
                    "x",
                ]
            )
            | st.text(max_size=4),
            children,
            max_size=8,
        )
    ),
    max_leaves=12,
)


@given(values=st.lists(json_values, min_size=1, max_size=4), fmt=st.sampled_from(FORMATS))
@fuzz_settings(2_000)
def test_random_json_values_raise_only_trace_errors(
    folder: Path, values: list[Any], fmt: str
) -> None:
    count("traces: random JSON values")
    data = b"\n".join(json.dumps(value).encode() for value in values)
    check_first_bad_line(folder / "values.jsonl", data, fmt)


@given(
    depth=st.integers(1, 200_000),
    opener=st.sampled_from([b"[", b'{"a":']),
    fmt=st.sampled_from(FORMATS),
)
@fuzz_settings(300)
def test_deep_nesting_is_a_trace_error(folder: Path, depth: int, opener: bytes, fmt: str) -> None:
    count("traces: deep nesting")
    result = check_first_bad_line(folder / "deep.jsonl", opener * depth, fmt)
    assert isinstance(result, TraceError) and result.line == 1


# ------------------------------------------------------------------------- mutated lines
def _field_mutations(form: str) -> list[str]:
    fields = ["timestamp", "input_length", "output_length", "hash_ids"]
    if form == "bailian":
        fields += ["chat_id", "parent_chat_id", "turn", "type"]
    return fields


BAD_VALUES: dict[str, list[Any]] = {
    # Every value here is wrong for every numeric field.
    "number": [
        None,
        "1",
        [],
        {},
        True,
        False,
        -1,
        -(10**30),
        float("nan"),
        float("inf"),
        float("-inf"),
        10**400,
        -0.5,
        [1],
    ],
    "type": [None, 1, 1.5, True, [], {"a": 1}],
    "hash_ids": [None, "1,2", 5, {}, True],
}


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, list[bytes], int, str]:
    """A valid trace with one line made bad; (form, lines, 1-based bad line, expected text)."""
    form, records = draw(traces(min_size=1))
    index = draw(st.integers(0, len(records) - 1))
    record = dict(records[index])
    kind = draw(
        st.sampled_from(
            ["remove", "bad value", "hash id", "bad utf-8", "duplicate key", "stray bom", "cut"]
        )
    )
    field = draw(st.sampled_from(_field_mutations(form)))
    expected = repr(field)
    if kind == "remove":
        # type and turn are optional in the Bailian form; removing them is no error.
        assume(field not in ("type", "turn"))
        del record[field]
        # A Mooncake line without hash_ids opening an auto-detected file is in no form at all.
        expected = repr(field) if field != "hash_ids" or index else "'hash_ids'"
        line = json.dumps(record).encode()
    elif kind == "bad value":
        group = "type" if field == "type" else "hash_ids" if field == "hash_ids" else "number"
        value = draw(st.sampled_from(BAD_VALUES[group]))
        if field == "parent_chat_id" and value == -1:
            value = -2
        record[field] = value
        line = json.dumps(record).encode()
    elif kind == "hash id":
        field = "hash_ids"
        expected = "hash_ids"
        ids = list(record["hash_ids"])
        position = draw(st.integers(0, len(ids)))
        bad = draw(st.sampled_from([-1, "7", 1.5, True, None, 2**64, [3], "drop", "add"]))
        if bad == "drop":
            assume(ids)
            del ids[min(position, len(ids) - 1)]
        elif bad == "add":
            ids.insert(position, 10**6 + position)
        else:
            ids.insert(position, bad)
        record["hash_ids"] = ids
        line = json.dumps(record).encode()
    elif kind == "bad utf-8":
        text = json.dumps(record).encode()
        cut = draw(st.integers(0, len(text)))
        line = text[:cut] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + text[cut:]
        expected = "not UTF-8"
    elif kind == "duplicate key":
        text = json.dumps(record)
        line = (text[:-1] + f", {json.dumps(field)}: {json.dumps(record[field])}}}").encode()
        expected = f"key {field!r} appears twice"
    elif kind == "stray bom":
        assume(index > 0)  # a BOM opening the file is fine
        line = b"\xef\xbb\xbf" + json.dumps(record).encode()
        expected = "not valid JSON"
    else:
        text = json.dumps(record).encode()
        line = text[: draw(st.integers(1, len(text) - 1))]
        expected = "not valid JSON"
    lines = encode(records)
    lines[index] = line
    return form, lines, index + 1, expected


@given(case=mutated(), explicit=st.booleans(), blank_lines=st.integers(0, 3))
@fuzz_settings(2_000)
def test_one_bad_line_is_named(
    folder: Path, case: tuple[str, list[bytes], int, str], explicit: bool, blank_lines: int
) -> None:
    count("traces: mutated valid lines")
    form, lines, bad_line, expected = case
    lines = [b""] * blank_lines + lines  # blank lines still count
    bad_line += blank_lines
    path = folder / "mutated.jsonl"
    result = check_first_bad_line(path, b"\n".join(lines) + b"\n", form if explicit else "auto")
    assert isinstance(result, TraceError), f"line {bad_line} accepted: {lines[bad_line - 1]!r}"
    assert result.line == bad_line, (result, lines[bad_line - 1])
    assert expected in result.problem, (expected, result)


def test_huge_integers_are_trace_errors_not_overflows(tmp_path: Path) -> None:
    """Found by fuzzing: 10**400 overflowed float arithmetic (OverflowError, no line)."""
    path = tmp_path / "huge.jsonl"
    line = {"timestamp": 10**400, "input_length": 1, "output_length": 0, "hash_ids": [1]}
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=r":1: field 'timestamp' must be at most"):
        list(read_trace(path))
    line = {"timestamp": 0, "input_length": 10**400, "output_length": MAX_INT + 1, "hash_ids": []}
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(TraceError, match=r":1: field 'input_length' must be <= "):
        list(read_trace(path))
    path.write_text('{"timestamp": ' + "9" * 5000 + "}\n")
    with pytest.raises(TraceError, match=r":1: .*digits"):
        list(read_trace(path))


def test_bad_utf8_names_its_line(tmp_path: Path) -> None:
    """Found by fuzzing: a bad byte was reported without a line number."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [1]})
    path.write_bytes(good.encode() + b"\n\n" + good.encode()[:-1] + b', "x": "\xe9"}\n')
    with pytest.raises(TraceError, match=r":3: not UTF-8 text"):
        list(read_trace(path))


def test_deep_nesting_and_duplicate_keys_are_trace_errors(tmp_path: Path) -> None:
    """Found by fuzzing: deep nesting raised RecursionError; a repeated key passed silently."""
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(TraceError, match=r":1: not valid JSON \(nested too deeply\)"):
        list(read_trace(path))
    path.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": [1], '
        '"input_length": 600}\n'
    )
    with pytest.raises(TraceError, match=r":1: key 'input_length' appears twice"):
        list(read_trace(path))


def test_bailian_line_without_chat_id_is_not_read_as_mooncake(tmp_path: Path) -> None:
    """Found by fuzzing: auto-detection took it for Mooncake and failed on a later line."""
    path = tmp_path / "bailian.jsonl"
    record = {"parent_chat_id": -1, "timestamp": 0, "input_length": 1, "output_length": 0}
    path.write_text(json.dumps({**record, "hash_ids": [1]}) + "\n")
    with pytest.raises(TraceError, match=r":1: missing field 'chat_id'"):
        list(read_trace(path))
