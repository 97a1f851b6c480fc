"""Fuzz the load test's options (``ReplaySettings``: validate, then plan the whole trace).

Each option gets a good or a bad command-line string, converted the way the locustfile's
parser does (``int``/``float``; a failed conversion is argparse's exit 2). The oracle: any bad
value means a ValueError (TraceError for the trace) naming the option or the file, raised
before anything is sent; all good means a plan with one entry per trace request. The key
never shows in a message. Locust itself is not imported here (it monkey-patches the process);
tests/loadtest drives the real locust command line.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fuzz_support import count, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from arc_loadtest.replay import ReplaySettings
from arc_serving_common.traces import TraceError

SECRET = "s3cret-KEY"
FLOAT_BAD = ["nan", "inf", "-inf", "1e999", "-1", "0", "abc", ""]
# option -> (converter, good strings, bad strings)
OPTIONS: dict[str, tuple[Any, list[str], list[str]]] = {
    "block_tokens": (int, ["0", "512"], ["-1", "-512", "x", "1.5", "", "16"]),
    "time_scale": (float, ["1", "0.5", "1e-3", "20"], FLOAT_BAD),
    "seed": (int, ["0", "7", "9" * 30], ["-1", "x", "1.5", ""]),
    "request_timeout": (float, ["600", "0.5"], FLOAT_BAD),
    "max_unreachable": (int, ["0", "10"], ["-1", "x", "2.5"]),
    "api_key": (str, ["", SECRET, "a-b_c.d~"], [f"{SECRET} x", f"{SECRET}\n", "\x00", "k\tey"]),
}
FLAGS = {name: "--" + name.replace("_", "-") for name in OPTIONS}


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-loadtest-") as name:
        path = Path(name)
        lines = [
            {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
            {"timestamp": 250, "input_length": 100, "output_length": 4, "hash_ids": [1]},
        ]
        (path / "good.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (path / "bad.jsonl").write_text(json.dumps(lines[0]) + '\n{"timestamp": "x"}\n')
        (path / "empty.jsonl").write_text("")
        (path / "dir").mkdir()
        yield path


@given(
    choices=st.fixed_dictionaries(
        {
            name: st.one_of(
                st.sampled_from(good).map(lambda value: (value, False)),
                st.sampled_from(bad).map(lambda value: (value, True)),
            )
            for name, (_, good, bad) in OPTIONS.items()
        }
    ),
    host=st.sampled_from(
        [
            ("http://127.0.0.1:8000", False),
            ("https://x/", False),
            ("127.0.0.1:8000", True),
            ("", True),
            ("ftp://x", True),
        ]
    ),
    trace=st.sampled_from(
        [("good.jsonl", False)] * 4
        + [
            ("bad.jsonl", True),
            ("empty.jsonl", True),
            ("missing.jsonl", True),
            ("dir", True),
            ("", True),
        ]
    ),
    trace_format=st.sampled_from([("auto", False), ("mooncake", False), ("bailian", True)]),
)
@fuzz_settings(3_000)
def test_bad_options_are_refused_by_name_before_anything_runs(
    folder: Path,
    choices: dict[str, tuple[str, bool]],
    host: tuple[str, bool],
    trace: tuple[str, bool],
    trace_format: tuple[str, bool],
) -> None:
    count("loadtest: replay options")
    values: dict[str, Any] = {}
    for name, (text, _) in choices.items():
        try:
            values[name] = OPTIONS[name][0](text)
        except ValueError:  # argparse exits with status 2, naming the option itself
            assert choices[name][1], (name, text)
            return
    options = SimpleNamespace(
        trace=str(folder / trace[0]) if trace[0] else "",
        trace_format=trace_format[0],
        results="",
        summary="",
        model="",
        tokenizer="",
        **values,
    )
    bad_option = [FLAGS[name] for name, (_, bad) in choices.items() if bad]
    bad_option += ["--host"] * host[1] + ["--trace"] * (not trace[0])
    bad = bool(bad_option) or trace[1] or trace_format[1]
    settings = ReplaySettings.from_options(options, host[0])
    try:
        settings.validate()
        plan = settings.load_plan()
    except TraceError as error:
        assert trace[1] or trace_format[1] or FLAGS["block_tokens"] in bad_option, error
        assert not bad_option or bad_option == [FLAGS["block_tokens"]], (bad_option, error)
        assert str(error).startswith(options.trace), error  # the file, then line and problem
    except ValueError as error:
        assert bad_option, error
        assert any(flag in str(error) for flag in bad_option), (bad_option, error)
        assert SECRET not in str(error), error
    else:
        assert not bad, (choices, host, trace, trace_format)
        assert len(plan) == 2


def test_infinite_time_scale_and_timeout_are_refused(folder: Path) -> None:
    """Found by fuzzing: inf passed "> 0" and would have scheduled every request at infinity."""
    options = SimpleNamespace(
        trace=str(folder / "good.jsonl"),
        trace_format="auto",
        block_tokens=0,
        time_scale=1.0,
        seed=0,
        results="",
        summary="",
        model="",
        tokenizer="",
        request_timeout=600.0,
        max_unreachable=10,
    )
    for name in ("time_scale", "request_timeout"):
        settings = ReplaySettings.from_options(
            SimpleNamespace(**{**vars(options), name: float("inf")}), "http://127.0.0.1:1"
        )
        with pytest.raises(ValueError, match=f"{FLAGS[name]} must be a finite number > 0"):
            settings.validate()
