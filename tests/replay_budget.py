"""Run-time bounds of the tests' Locust replays, derived from the work each replay holds.

A replay quits once its last answer has arrived, so ``--run-time`` only bounds a replay that
hangs; a test that waits for every answer must not lose requests to a bound tuned to a fast
machine. The bound here is the trace's span at the replay's time scale plus REQUEST_BOUND_S
for each request, as if every request were answered only after the one before: it grows with
the work, holds on a slow and busy machine, and no passing test waits for it.
"""

from __future__ import annotations

import math
from pathlib import Path

from arc_serving_common.traces import load_trace

# One request of the tests' small prompts and outputs on the tiny model, on a slow, busy
# machine, with room to spare (they take well under a second on two quiet cores).
REQUEST_BOUND_S = 20.0


def replay_run_time_s(
    trace: str | Path, *, time_scale: float = 1.0, block_tokens: int | None = None
) -> int:
    """The ``--run-time`` for replaying ``trace``: its span times ``time_scale`` plus
    REQUEST_BOUND_S per request."""
    requests = load_trace(trace, block_tokens=block_tokens)
    span_s = requests[-1].timestamp_s - requests[0].timestamp_s
    return math.ceil(span_s * time_scale + len(requests) * REQUEST_BOUND_S)
