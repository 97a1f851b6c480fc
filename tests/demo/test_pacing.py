"""The demos' pacing (``arc_dev.pacing``): the replay speed follows the measured server, so
the same trace offers the same share of work on a slow machine as on a fast one."""

from __future__ import annotations

import threading

import pytest

from arc_dev.pacing import (
    TARGET_UTILIZATION,
    Calibration,
    ProgressReporter,
    measure_cost,
    pace,
    parse_time_scale,
    service_seconds,
)
from arc_serving_common.traces import TraceRequest
from arc_simulator.simulate import CostModel

COST = CostModel(prefill_seconds_per_token=1e-3, decode_seconds_per_token=0.01, step_seconds=0.02)


def request(index: int, timestamp_s: float, input_tokens: int = 100) -> TraceRequest:
    return TraceRequest(
        index=index,
        line=index + 1,
        timestamp_s=timestamp_s,
        input_length=input_tokens,
        output_length=4,
        hash_ids=(index,),
        keys=(index,),
        block_tokens=100,
    )


TRACE = [request(n, 1.0 * n) for n in range(11)]  # 10 s


def test_a_request_costs_its_uncached_prompt_and_its_output() -> None:
    assert service_seconds(TRACE[0], COST, 0.0) == pytest.approx(0.02 + 0.1 + 0.04)
    assert service_seconds(TRACE[0], COST, 0.5) == pytest.approx(0.02 + 0.05 + 0.04)


def test_pace_offers_the_target_share_of_the_measured_capacity() -> None:
    chosen = pace(TRACE, COST, 0.0)
    assert chosen.work_s == pytest.approx(11 * 0.16)
    assert chosen.utilization == pytest.approx(TARGET_UTILIZATION)
    assert chosen.duration_s == pytest.approx(10 * chosen.time_scale)


def test_a_twice_slower_server_gets_a_twice_slower_replay_and_the_same_load() -> None:
    slow = CostModel(prefill_seconds_per_token=2e-3, decode_seconds_per_token=0.02,
                     step_seconds=0.04)  # fmt: skip
    fast, slower = pace(TRACE, COST, 0.2), pace(TRACE, slow, 0.2)
    assert slower.time_scale == pytest.approx(2 * fast.time_scale)
    assert slower.utilization == pytest.approx(fast.utilization)


def test_more_servers_share_the_work() -> None:
    one, two = pace(TRACE, COST, 0.0), pace(TRACE, COST, 0.0, servers=2)
    assert two.time_scale == pytest.approx(one.time_scale / 2)
    assert two.utilization == pytest.approx(one.utilization)


def test_a_given_time_scale_is_kept_and_its_load_reported() -> None:
    chosen = pace(TRACE, COST, 0.0, time_scale=1.0)
    assert chosen.time_scale == 1.0
    assert chosen.utilization == pytest.approx(11 * 0.16 / 10)


def test_the_deadline_covers_the_schedule_and_all_the_work_done_serially() -> None:
    chosen = pace(TRACE, COST, 0.0)
    assert chosen.deadline_s() >= chosen.duration_s + chosen.work_s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"utilization": 1.0}, "utilization must be in (0, 1)"),
        ({"servers": 0}, "servers must be at least 1"),
    ],
)
def test_bad_pace_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pace(TRACE, COST, 0.0, **kwargs)


def test_an_empty_trace_has_no_pace() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        pace([], COST, 0.0)


@pytest.mark.parametrize(("text", "value"), [("auto", None), ("0.5", 0.5), ("100", 100.0)])
def test_time_scale_is_auto_or_a_factor(text: str, value: float | None) -> None:
    assert parse_time_scale(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "101", "nan", "fast", ""])
def test_a_bad_time_scale_names_itself(text: str) -> None:
    with pytest.raises(ValueError, match=f"got {text!r}"):
        parse_time_scale(text)


def test_calibration_turns_timings_into_a_cost_model() -> None:
    calibration = Calibration(prompt_tokens=1000, miss_s=0.25, hit_s=0.05, decode_s=0.01)
    cost = calibration.cost_model()
    assert cost.prefill_seconds_per_token == pytest.approx(0.2 / 1000)
    assert cost.step_seconds == 0.05
    assert cost.decode_seconds_per_token == 0.01
    assert "1000-token prompt uncached 250 ms, cached 50 ms" in calibration.describe()


class ColdStartServer:
    """A server on a simulated clock whose first request costs a one-time set-up, as a fresh
    vLLM CPU server's does: uncached prompts cost ``miss_s``, cached ones ``hit_s``, each
    output token after the first ``decode_s``."""

    SETUP_S, MISS_S, HIT_S, DECODE_S = 1.0, 0.1, 0.01, 0.001

    def __init__(self) -> None:
        self.now = 0.0
        self.cached: set[tuple[int, ...]] = set()
        self.calls: list[tuple[tuple[int, ...], int]] = []

    def clock(self) -> float:
        return self.now

    def complete(self, prompt: list[int], max_tokens: int) -> None:
        key = tuple(prompt)
        self.now += self.SETUP_S if not self.calls else 0.0
        self.now += self.HIT_S if key in self.cached else self.MISS_S
        self.now += (max_tokens - 1) * self.DECODE_S
        self.cached.add(key)
        self.calls.append((key, max_tokens))


def test_the_server_is_warmed_up_before_it_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ColdStartServer()
    monkeypatch.setattr("arc_dev.pacing.time.perf_counter", server.clock)
    calibration = measure_cost(server.complete, 64, rounds=3)
    # The one-time set-up is paid by the warm-up, not read as the cost of a prompt.
    assert calibration.miss_s == pytest.approx(server.MISS_S)
    assert calibration.hit_s == pytest.approx(server.HIT_S)
    assert calibration.decode_s == pytest.approx(server.DECODE_S)
    warm, timed = server.calls[:9], server.calls[9:]
    assert len(timed) == 9
    assert not {prompt for prompt, _ in warm} & {prompt for prompt, _ in timed}
    assert {prompt[0] for prompt, _ in server.calls[:3] + server.calls[9:12]} == {
        prompt[0] for prompt in server.cached
    }, "every prompt starts with its own token, so none hits another's first block"


def test_progress_lines_count_answers_and_say_what_is_left() -> None:
    reporter = ProgressReporter("lru", 300, lambda: 0, scheduled_s=80.0)
    assert reporter.line(100, 50.0) == (
        "lru: 100/300 requests answered after 50 s, the last one is sent in 30 s"
    )
    assert (
        reporter.line(290, 85.0)
        == "lru: 290/300 requests answered after 85 s, all sent, 10 awaited"
    )
    assert reporter.line(300, 90.0) == "lru: 300/300 requests answered after 90 s"


def test_progress_is_printed_while_the_replay_runs_and_stops_with_it() -> None:
    lines: list[str] = []
    printed = threading.Event()
    answered = iter(range(1, 1000))

    def record(line: str) -> None:
        lines.append(line)
        printed.set()

    with ProgressReporter(
        "arc", 10, lambda: next(answered), scheduled_s=5.0, print_line=record, interval_s=0.01
    ):
        assert printed.wait(30)
    count = len(lines)
    assert lines[0].startswith("arc: 1/10 requests answered after ")
    printed.clear()
    assert not printed.wait(0.1)  # nothing after the replay ended
    assert len(lines) == count


def test_a_failing_progress_read_is_reported_not_raised() -> None:
    lines: list[str] = []
    printed = threading.Event()

    def broken() -> int:
        raise ConnectionError("refused")

    def record(line: str) -> None:
        lines.append(line)
        printed.set()

    with ProgressReporter("trio", 10, broken, scheduled_s=5.0, print_line=record, interval_s=0.01):
        assert printed.wait(30)
    assert lines[0] == "trio: progress unavailable (refused)"
