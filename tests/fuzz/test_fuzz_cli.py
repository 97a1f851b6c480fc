"""Fuzz ``arc-evictor simulate|generate|evaluate`` argument vectors, in process.

Each option gets no value, a good value or a bad one (capacities like ``0``, ``-1``,
``1e999``, ``nan``; unknown or mixed-case policies; missing files; folders as files; outputs
under a regular file). The oracle: any bad value means exit status 2, exactly one line on
stderr naming the problem, no traceback, and the working folder unchanged (same entries,
same bytes, same mtimes, including an existing output file); no bad value means exit 0.
``evaluate`` always gets at least one bad value (a good run takes minutes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import count, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from arc_simulator.cli import main

# Placeholders replaced by paths inside the example's folder.
VALID, BAD, EMPTY, MISSING, FOLDER, EXISTING = (
    "@valid.jsonl",
    "@bad.jsonl",
    "@empty.jsonl",
    "@missing.jsonl",
    "@folder",
    "@existing.out",
)
UNDER_FILE = "@valid.jsonl/out.png"  # a path whose "folder" is a regular file
NEW_OUTPUT = "@new/sub/out"  # a path in folders that do not exist yet

Option = tuple[str, str | None, bool]  # (flag, value or None for a bare flag, is it bad)


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-cli-") as name:
        yield Path(name)


def make_case_folder(root: Path) -> Path:
    folder = Path(tempfile.mkdtemp(dir=root))
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [1, 4]},
    ]
    (folder / "valid.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "bad.jsonl").write_text(json.dumps(lines[0]) + '\n{"timestamp": -1}\n')
    (folder / "empty.jsonl").write_text("")
    (folder / "folder").mkdir()
    (folder / "existing.out").write_bytes(b"keep me")
    return folder


def snapshot(folder: Path) -> dict[str, tuple[Any, ...]]:
    state: dict[str, tuple[Any, ...]] = {}
    for path in sorted(folder.rglob("*")):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        state[str(path.relative_to(folder))] = (digest, stat.st_size, stat.st_mtime_ns)
    return state


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def resolve(value: str, folder: Path) -> str:
    return str(folder / value[1:]) if value.startswith("@") else value


def option(flag: str, good: list[str], bad: list[str]) -> st.SearchStrategy[list[Option]]:
    """Absent (most often), a good value, or a bad one."""
    choices = [st.just([])]
    if good:
        choices.append(st.sampled_from(good).map(lambda value: [(flag, value, False)]))
    choices.append(st.sampled_from(bad).map(lambda value: [(flag, value, True)]))
    return st.one_of(choices)


def check(argv: list[str], bad: bool, folder: Path, outputs: tuple[str, ...] = ()) -> None:
    before = snapshot(folder)
    code, _, err = run(argv)
    assert "Traceback" not in err, (argv, err)
    if bad:
        assert code == 2, (argv, code, err)
        lines = err.splitlines()
        assert len(lines) == 1 and "error:" in lines[0], (argv, err)
        assert snapshot(folder) == before, f"{argv} changed files before failing"
    else:
        assert code == 0, (argv, code, err)
        after = snapshot(folder)
        changed = {name for name in set(before) | set(after) if before.get(name) != after.get(name)}
        allowed = {name for name in changed if any(name.startswith(out) for out in outputs)}
        assert changed == allowed, (argv, changed - allowed)


def flatten(options: list[list[Option]]) -> tuple[list[str], bool]:
    argv: list[str] = []
    bad = False
    for group in options:
        for flag, value, is_bad in group:
            argv.append(flag)
            if value is not None:
                argv.append(value)
            bad = bad or is_bad
    return argv, bad


FLOAT_BAD = ["nan", "inf", "-inf", "1e999", "-1", "abc", "", "1,5", "0x10"]
UNKNOWN = option("--bogus", ["--bogus"], ["--bogus"]).map(
    lambda group: [("--bogus", None, True)] if group else []
)

simulate_options = st.tuples(
    option(
        "--policy",
        ["lru", "ARC", "Lru,dbl", "arc , lru", "dbl,belady"],
        ["", ",", "lfu", "arc,xyz", "LRU;ARC", "arc,,", "nan"],
    ),
    option(
        "--capacity",
        ["10%", "5", "1,2", "50%,3", " 4 ", "1000%", "100.5%"],
        [
            "0",
            "-1",
            "1e999",
            "nan",
            "abc",
            "",
            "0%",
            "1001%",
            "nan%",
            "inf%",
            "-5%",
            "10%,abc",
            "1.5",
            "%",
            "5,,6",
            "1e3",
        ],
    ),
    option("--format", ["auto", "mooncake"], ["bailian", "MOONCAKE", "json", ""]),
    option("--block-tokens", ["512"], ["0", "-1", "abc", "1e3", "", "16", "9" * 40]),
    option("--prefill-tokens-per-second", ["20000", "1e3", "0.5"], ["0", *FLOAT_BAD]),
    option("--decode-seconds-per-token", ["0", "0.02"], FLOAT_BAD),
    option("--step-seconds", ["0", "0.005", "1e-9"], FLOAT_BAD),
    option("--max-batch-tokens", ["1", "1000000", "9" * 30], ["0", "-5", "1.5", "abc", ""]),
    st.sampled_from([[], [], [], [], [], [], [], [], [("--plot", NEW_OUTPUT + ".png", False)]])
    | option("--plot", [EXISTING + ".png"], [FOLDER, UNDER_FILE, "@existing.out/x.png"]),
    st.sampled_from([[], [("--json", None, False)], [("--sequential", None, False)]]),
    UNKNOWN,
)


@given(
    trace=st.sampled_from(
        [(VALID, False)] * 4
        + [(BAD, True), (EMPTY, True), (MISSING, True), (FOLDER, True), ("", True)]
    ),
    options=simulate_options,
    order=st.randoms(use_true_random=False),
)
@fuzz_settings(2_000)
def test_simulate_bad_options_exit_2_and_change_nothing(
    root: Path, trace: tuple[str, bool], options: tuple[list[Option], ...], order: Any
) -> None:
    count("cli: simulate argv")
    folder = make_case_folder(root)
    groups = list(options)
    order.shuffle(groups)
    argv, bad = flatten(groups)
    argv = ["simulate", resolve(trace[0], folder), *(resolve(arg, folder) for arg in argv)]
    check(argv, bad or trace[1], folder, outputs=("new", "existing.out.png"))
    shutil.rmtree(folder)


def generate_options(workload: str) -> st.SearchStrategy[tuple[list[Option], ...]]:
    counts = ["1", "3"]
    count_bad = ["0", "-1", "abc", "1.5", "", "99999999999999", "1e999"]
    float_good = ["0.5", "2", "1e-3"]
    tokens_good = ["1", "40", "700"]
    tokens_bad = ["0", "-3", "x", "5000000", "2.5"]
    shared = (
        option("--output-tokens", tokens_good, tokens_bad),
        option("--seed", ["0", "-7", "9" * 30], ["a", "", "1.5", "nan"]),
        option("--form", ["bailian", "mooncake"], ["qwen", "MOONCAKE", ""]),
        option("--block-tokens", ["16", "1", "512"], ["0", "-16", "1e2", ""]),
        UNKNOWN,
    )
    if workload == "docqa":
        own = (
            option("--documents", counts, count_bad),
            option("--document-tokens", tokens_good, tokens_bad),
            option("--questions-per-document", float_good, [*FLOAT_BAD, "0", "1e12"]),
            option(
                "--zipf-exponent", ["0", "0.8", "2"], [f for f in FLOAT_BAD if f != "-1"] + ["-0.1"]
            ),
            option("--question-tokens", tokens_good, tokens_bad),
            option("--system-tokens", ["0", "30"], ["-100", "x", "5000000"]),
            option("--requests-per-second", float_good, ["0", *FLOAT_BAD]),
            option("--sessions", [], ["3"]),  # a conversation parameter
        )
    else:
        own = (
            option("--sessions", counts, count_bad),
            option("--system-prompts", counts, count_bad),
            option("--system-tokens", tokens_good, tokens_bad),
            option("--mean-turns", ["1", "2.5"], ["0", *FLOAT_BAD]),
            option("--max-turns", ["1", "4"], count_bad),
            option("--user-tokens", tokens_good, tokens_bad),
            option("--think-time-s", ["0", "3.5"], FLOAT_BAD),
            option("--sessions-per-second", float_good, ["0", *FLOAT_BAD]),
            option("--documents", [], ["3"]),  # a document-QA parameter
        )
    return st.tuples(*own, *shared)


# Small sizes that every good generate run starts from, so a good run stays fast.
SMALL = {
    "docqa": ["--documents", "2", "--questions-per-document", "2", "--document-tokens", "300"],
    "conversation": ["--sessions", "2", "--max-turns", "3", "--system-tokens", "50"],
}


@given(
    workload=st.sampled_from(["docqa", "conversation", "chat", ""]),
    out=st.sampled_from(
        [
            (NEW_OUTPUT + ".jsonl", False),
            (EXISTING, False),
            (FOLDER, True),
            (UNDER_FILE, True),
            ("@missing/x/y.jsonl", False),
            (None, True),
        ]
    ),
    data=st.data(),
)
@fuzz_settings(2_000)
def test_generate_bad_options_exit_2_and_change_nothing(
    root: Path, workload: str, out: tuple[str | None, bool], data: st.DataObject
) -> None:
    count("cli: generate argv")
    folder = make_case_folder(root)
    known = workload if workload in SMALL else "docqa"
    argv, bad = flatten(list(data.draw(generate_options(known))))
    out_args = [] if out[0] is None else ["--out", resolve(out[0], folder)]
    argv = ["generate", workload, *SMALL[known], *out_args, *argv]
    bad = bad or out[1] or workload not in SMALL
    check(argv, bad, folder, outputs=("new", "missing", "existing.out"))
    shutil.rmtree(folder)


@given(
    options=st.tuples(
        option("--out", ["@fresh", FOLDER], [EXISTING, UNDER_FILE, VALID]),
        option("--seeds", ["0", "1,2", "-3"], ["a", "", "1.5", "0,,1", "nan", "0;1"]),
        option(
            "--capacity",
            ["5,10", "40", "5%"],
            ["0", "101", "nan", "abc", "", "-5", "1e999", "inf", "5,,10"],
        ),
        option("--mode", ["both", "sequential"], ["all", "BOTH", ""]),
        option("--candidate", ["lru", "ARC", " trio "], ["xyz", "lfu", "arc,lru"]),
        st.sampled_from([[], [("--check", None, False)]]),
        UNKNOWN,
    ),
    order=st.randoms(use_true_random=False),
)
@fuzz_settings(2_000)
def test_evaluate_bad_options_exit_2_and_change_nothing(
    root: Path, options: tuple[list[Option], ...], order: Any
) -> None:
    count("cli: evaluate argv")
    folder = make_case_folder(root)
    groups = list(options)
    order.shuffle(groups)
    argv, bad = flatten(groups)
    if not bad:  # a good evaluation runs for minutes: make one value bad
        argv += ["--capacity", "0"]
    check(["evaluate", *(resolve(arg, folder) for arg in argv)], True, folder)
    shutil.rmtree(folder)


def test_one_line_errors_and_no_folder_made_on_failure(tmp_path: Path) -> None:
    """Found by fuzzing: argparse printed a usage block, and --plot made its folder even when
    the run then failed on the trace."""
    code, _, err = run(["simulate", str(tmp_path / "none.jsonl"), "--capacity"])
    assert code == 2 and len(err.splitlines()) == 1, err
    code, _, err = run(
        ["simulate", str(tmp_path / "none.jsonl"), "--plot", str(tmp_path / "new" / "p.png")]
    )
    assert code == 2 and "cannot open trace" in err, err
    assert list(tmp_path.iterdir()) == []


def test_bad_generate_values_are_refused(tmp_path: Path) -> None:
    """Found by fuzzing: a conversation option was ignored for docqa, negative system tokens
    were accepted, and an infinite prefill rate passed as free prefill."""
    out = str(tmp_path / "t.jsonl")
    code, _, err = run(["generate", "docqa", "--out", out, "--sessions", "3"])
    assert code == 2 and "--sessions: not a parameter of the docqa workload" in err, err
    code, _, err = run(["generate", "docqa", "--out", out, "--system-tokens", "-100"])
    assert code == 2 and "system_tokens must be >= 0" in err, err
    code, _, err = run(["generate", "docqa", "--out", out, "--documents", "99999999999"])
    assert code == 2 and "documents must be at most" in err, err
    assert list(tmp_path.iterdir()) == []
    code, _, err = run(["simulate", out, "--prefill-tokens-per-second", "inf"])
    assert code == 2 and "--prefill-tokens-per-second must be a finite number" in err, err


def test_evaluate_refuses_an_output_that_is_a_file(tmp_path: Path) -> None:
    """Found by fuzzing: --out naming a file ran the evaluation, then failed with a traceback."""
    target = tmp_path / "taken"
    target.write_text("x")
    code, _, err = run(["evaluate", "--out", str(target), "--seeds", "0", "--mode", "sequential"])
    assert code == 2 and "--out" in err and "Traceback" not in err, err
    assert target.read_text() == "x"


fleet_options = st.tuples(
    option("--replicas", ["1", "2", "3"], ["0", "-1", "abc", "", "1.5", "5000", "9" * 30]),
    option(
        "--router",
        ["kv_aware", "round_robin,cache_aware", "RANDOM", "consistent_hash"],
        ["", ",", "nearest", "kv_aware,,", "kv_aware;random"],
    ),
    option("--seed", ["0", "7"], ["abc", "1.5", ""]),
    st.sampled_from(["lru", "arc,lru", "lru,belady"]),
    st.sampled_from([[], [("--sequential", None, False)], [("--json", None, False)]]),
)


@given(options=fleet_options, order=st.randoms(use_true_random=False))
@fuzz_settings(400)
def test_simulate_fleet_options_exit_2_when_bad_and_change_nothing(
    root: Path, options: tuple[Any, ...], order: Any
) -> None:
    count("cli: simulate fleet argv")
    replicas, router, seed, policies, mode = options
    folder = make_case_folder(root)
    groups = [replicas, router, seed, mode, [("--policy", policies, False)]]
    order.shuffle(groups)
    argv, bad = flatten(groups)
    # A router needs a replica count and a replica count needs routers; Belady cannot
    # see a fleet's per-replica future.
    bad = bad or bool(replicas) != bool(router)
    if replicas and not replicas[0][2] and int(replicas[0][1]) > 1 and "belady" in policies:
        bad = True
    check(["simulate", str(folder / "valid.jsonl"), "--capacity", "2", *argv], bad, folder)
    shutil.rmtree(folder)
