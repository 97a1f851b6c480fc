"""Dispatch-lag benchmark of the open-loop scheduler (for ``make bench``; no server).

Each request does the client-side work of the replay (token mapping of its blocks, the JSON
body) and then waits ``service_s`` as if streaming, so many requests are in flight while the
dispatcher keeps time. The figure is the dispatcher's own lateness (the target: p99 under
50 ms at the demo's request rate); the real run reports the same figure with the server.
"""

from __future__ import annotations

import json
from typing import Any

import gevent

from arc_loadtest.report import percentiles
from arc_loadtest.schedule import Dispatcher, DispatchTiming, PlannedRequest, plan_replay
from arc_loadtest.stream import completion_body
from arc_loadtest.tokens import TokenMapper, Vocabulary
from arc_serving_common.traces import TraceRequest


def bench_dispatch(
    *, rate_rps: float = 20.0, requests: int = 400, blocks: int = 32, service_s: float = 2.0
) -> dict[str, Any]:
    """Replay ``requests`` evenly spaced at ``rate_rps``; returns dispatch-lag percentiles."""
    mapper = TokenMapper(Vocabulary.build(range(32_000), [], "bench"), seed=0, block_tokens=32)
    trace = [
        TraceRequest(
            index=i,
            line=i + 1,
            timestamp_s=i / rate_rps,
            input_length=blocks * 32,
            output_length=64,
            hash_ids=tuple(range(i, i + blocks)),
            keys=(),
            block_tokens=32,
        )
        for i in range(requests)
    ]
    lags: list[float] = []

    def send(planned: PlannedRequest, timing: DispatchTiming) -> None:
        lags.append(timing.lag_s)
        request = planned.request
        body = completion_body("m", mapper.prompt(request.hash_ids, request.input_length), 64)
        json.dumps(body)
        gevent.sleep(service_s)

    dispatcher = Dispatcher(plan_replay(trace, 1.0), send)
    dispatcher.start()
    dispatcher.join(timeout=requests / rate_rps + service_s + 60)
    return {"rate_rps": rate_rps, "requests": len(lags), "dispatch_lag_s": percentiles(lags)}


if __name__ == "__main__":
    for rate in (5.0, 20.0, 50.0):
        print(json.dumps(bench_dispatch(rate_rps=rate, requests=int(rate * 10))))
