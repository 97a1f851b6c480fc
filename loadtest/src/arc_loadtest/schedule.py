"""Open-loop replay schedule: when each trace request is sent, and by which worker.

Open loop: request i is due ``(timestamp_i - timestamp_0) * time_scale`` seconds after the
start, whatever the server does with earlier requests. The one exception is a session
(Qwen-Bailian ``parent_chat_id``): turn n+1 is a reply to turn n's answer, so it is sent at
its due time or when turn n finished, whichever is later. A parent that is not in the trace
(a cut sample) gates nothing.

Distributed runs split the trace by session: the sessions' roots, in file order, are dealt
round robin to ``parts`` workers, so every request is sent exactly once and a session never
spans two workers (its ordering needs no messages between workers).

Every request carries a session id, sent as ``X-Session-ID`` so a session-keyed router
(the vLLM router's ``consistent_hash``) keeps a conversation on one replica:
``arc_serving_common.sessions`` names it (the root chat id where the trace links turns, else
the conversation its chain of blocks continues), and the simulator's ``consistent_hash``
router hashes the same key (docs/routing.md).

Two delays are reported per request: ``held_s``, how long a session turn waited for its
parent beyond its due time (the server's doing), and ``lag_s``, how late the dispatcher sent
it after it became ready (the load generator's own error, the figure the target bounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gevent
import gevent.event
import gevent.pool

from arc_serving_common.sessions import session_keys
from arc_serving_common.traces import TraceError, TraceRequest


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """A trace request with its due time and the request that gates it."""

    request: TraceRequest
    due_s: float  # seconds after the replay's start
    parent: int | None  # index of the earlier turn that must finish first
    session: int  # index of the session's first request
    session_id: str  # the X-Session-ID header: arc_serving_common.sessions.session_keys


@dataclass(frozen=True, slots=True)
class DispatchTiming:
    """When a request was due, became ready and was sent, in seconds after the start."""

    due_s: float
    ready_s: float  # max(due, parent finished)
    sent_s: float

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.ready_s

    @property
    def held_s(self) -> float:
        return self.ready_s - self.due_s


def plan_replay(
    requests: Sequence[TraceRequest], time_scale: float, *, path: str = "trace"
) -> list[PlannedRequest]:
    """Due times and session links for a whole trace (in file order).

    Raises ``TraceError`` naming the line for a duplicate ``chat_id`` or a turn whose parent
    comes later in the file (it could never be sent in order).
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if not requests:
        return []
    start = requests[0].timestamp_s
    by_chat: dict[int, TraceRequest] = {}
    later_chats = {r.chat_id for r in requests if r.chat_id is not None}
    sessions: dict[int, int] = {}  # request index -> session root index
    session_ids = session_keys(requests)
    plan = []
    for request, session_id in zip(requests, session_ids, strict=True):
        parent: int | None = None
        if request.parent_id is not None:
            earlier = by_chat.get(request.parent_id)
            if earlier is not None:
                parent = earlier.index
            elif request.parent_id in later_chats:
                raise TraceError(
                    path,
                    request.line,
                    f"parent_chat_id {request.parent_id} appears after its child turn",
                )
        if request.chat_id is not None:
            if request.chat_id in by_chat:
                first = by_chat[request.chat_id].line
                raise TraceError(
                    path, request.line, f"chat_id {request.chat_id} already used on line {first}"
                )
            by_chat[request.chat_id] = request
        sessions[request.index] = request.index if parent is None else sessions[parent]
        plan.append(
            PlannedRequest(
                request=request,
                due_s=(request.timestamp_s - start) * time_scale,
                parent=parent,
                session=sessions[request.index],
                session_id=session_id,
            )
        )
    return plan


def partition(plan: Sequence[PlannedRequest], part: int, parts: int) -> list[PlannedRequest]:
    """Worker ``part``'s share of ``plan`` (of ``parts``): whole sessions, round robin."""
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"part must be in [0, {parts}), got {part} of {parts}")
    roots = {p.session for p in plan}
    rank = {root: n for n, root in enumerate(sorted(roots))}
    return [p for p in plan if rank[p.session] % parts == part]


SendFn = Callable[[PlannedRequest, DispatchTiming], None]


class Dispatcher:
    """Sends planned requests at their due times, each from its own greenlet.

    Invariants: a request is sent at most once; a gated turn is sent only after its parent's
    ``send`` returned (or raised); ``send`` never delays another request's dispatch, so the
    schedule does not depend on response times. ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        plan: Sequence[PlannedRequest],
        send: SendFn,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._plan = sorted(plan, key=lambda p: (p.due_s, p.request.index))
        self._send = send
        self._clock = clock
        self._finished: dict[int, gevent.event.AsyncResult] = {
            p.request.index: gevent.event.AsyncResult() for p in self._plan
        }
        self._pool = gevent.pool.Group()
        self._loop: gevent.Greenlet | None = None
        self._start = 0.0
        self.sent = 0

    def start(self, at: float | None = None) -> None:
        """Start the schedule; due time 0 is clock time ``at`` (default: now)."""
        if self._loop is not None:
            raise RuntimeError("a Dispatcher starts once")
        self._start = self._clock() if at is None else at
        self._loop = gevent.spawn(self._run)

    def _run(self) -> None:
        for planned in self._plan:
            delay = self._start + planned.due_s - self._clock()
            if delay > 0:
                gevent.sleep(delay)
            self._pool.spawn(self._dispatch, planned)

    def _dispatch(self, planned: PlannedRequest) -> None:
        ready_s = planned.due_s
        if planned.parent is not None and planned.parent in self._finished:
            ready_s = max(ready_s, self._finished[planned.parent].get() - self._start)
        timing = DispatchTiming(
            due_s=planned.due_s, ready_s=ready_s, sent_s=self._clock() - self._start
        )
        self.sent += 1
        try:
            self._send(planned, timing)
        finally:
            self._finished[planned.request.index].set(self._clock())

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every request was sent and answered; False on timeout."""
        if self._loop is None:
            raise RuntimeError("join() before start()")
        deadline = None if timeout is None else self._clock() + timeout
        self._loop.join(timeout=timeout)
        if not self._loop.dead:
            return False
        remaining = None if deadline is None else max(0.0, deadline - self._clock())
        return self._pool.join(timeout=remaining)

    def stop(self) -> None:
        """Stop dispatching and abandon requests in flight."""
        if self._loop is not None:
            self._loop.kill(block=True)
        self._pool.kill(block=True)
