"""The Lease elector's decisions (arc_operator.leadership) and the entry point's flow around
them (arc_operator.__main__), against an in-memory Lease store that answers as the API server
does (404 for an absent Lease, 409 for a create of an existing one or a PUT with a stale
resourceVersion) and a virtual clock: no test waits for real time but a bounded poll."""

from __future__ import annotations

import asyncio
import copy
import heapq
import itertools
import os
import re
import signal
import socket
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest

from arc_harness.vllm_server import free_port
from arc_operator import __main__ as entry
from arc_operator.kube import ApiError
from arc_operator.leadership import (
    LEASE_DURATION_S,
    RENEW_DEADLINE_S,
    RETRY_PERIOD_S,
    LeaseElector,
    default_identity,
)

NS, NAME = "arc-system", "rel-arc-serving-operator"
COLLECTION = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
PATH = f"{COLLECTION}/{NAME}"
MICROTIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


class VirtualTime:
    """A monotonic clock and a sleep on it: ``advance`` wakes the sleepers in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def clock(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return datetime(2030, 1, 1, tzinfo=UTC) + timedelta(seconds=self.now)

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), future))
        await future

    async def settle(self) -> None:
        """Let every task run until it sleeps (the store answers without waiting)."""
        for _ in range(20):
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move the clock forward, waking each sleeper at its time."""
        end = self.now + seconds
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= end:
            when, _, future = heapq.heappop(self._sleepers)
            self.now = max(self.now, when)
            if not future.done():
                future.set_result(None)
            await self.settle()
        self.now = end

    async def until(self, what: str, done: Callable[[], bool], limit: float = 120) -> float:
        """Advance in small steps until ``done()``; the virtual time it took."""
        start = self.now
        while not done():
            assert self.now - start < limit, f"{what}: not within {limit} virtual seconds"
            await self.advance(0.1)
        return self.now - start


class LeaseStore:
    """The API server's side of one namespace's Leases: resourceVersion bumped at every write,
    optimistic concurrency on PUT. ``requests`` logs (caller, method, path); ``down`` makes a
    caller's requests fail as an unreachable server's do; ``hang`` makes them never answer;
    ``after_get`` runs once, between a caller's read and its write."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.down: set[str] = set()
        self.hang: set[str] = set()
        self.after_get: Callable[[], None] | None = None
        self._version = itertools.count(1)

    def api(self, caller: str) -> Any:
        store = self

        class Api:
            async def request(
                self, method: str, path: str, *, body: Any = None
            ) -> dict[str, Any] | None:
                return await store.handle(caller, method, path, body)

        return Api()

    def write(self, name: str, spec: dict[str, Any]) -> None:
        """Someone else's write of Lease ``name``."""
        lease = self.leases.setdefault(
            name, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {}}
        )
        lease["metadata"].update(name=name, namespace=NS, resourceVersion=str(next(self._version)))
        lease["spec"] = copy.deepcopy(spec)

    async def handle(self, caller: str, method: str, path: str, body: Any) -> dict[str, Any] | None:
        self.requests.append((caller, method, path))
        await asyncio.sleep(0)
        if caller in self.hang:
            await asyncio.Event().wait()
        if caller in self.down:
            raise ApiError(0, f"{method} {path}: connection refused")
        if method == "GET":
            found = copy.deepcopy(self.leases.get(path.rsplit("/", 1)[1]))
            if self.after_get is not None:
                hook, self.after_get = self.after_get, None
                hook()
            return found
        if method == "POST" and path == COLLECTION:
            name = body["metadata"]["name"]
            if name in self.leases:
                raise ApiError(409, f'leases "{name}" already exists')
            self.write(name, body["spec"])
            return copy.deepcopy(self.leases[name])
        if method == "PUT":
            name = path.rsplit("/", 1)[1]
            stored = self.leases.get(name)
            if stored is None:
                return None
            if body["metadata"].get("resourceVersion") != stored["metadata"]["resourceVersion"]:
                raise ApiError(409, "the object has been modified")
            self.write(name, body["spec"])
            return copy.deepcopy(self.leases[name])
        raise AssertionError(f"unexpected request {method} {path}")

    def spec(self) -> dict[str, Any]:
        return dict(self.leases[NAME]["spec"])


@pytest.fixture
def time_() -> VirtualTime:
    return VirtualTime()


@pytest.fixture
def store() -> LeaseStore:
    return LeaseStore()


@pytest.fixture
def elector(store: LeaseStore, time_: VirtualTime) -> Callable[[str], LeaseElector]:
    def make(identity: str) -> LeaseElector:
        return LeaseElector(
            store.api(identity), NS, NAME, identity,
            clock=time_.clock, now=time_.wall, sleep=time_.sleep,
        )  # fmt: skip

    return make


def foreign(holder: str = "other_1", **changes: Any) -> dict[str, Any]:
    spec = {
        "holderIdentity": holder,
        "leaseDurationSeconds": LEASE_DURATION_S,
        "acquireTime": "2030-01-01T00:00:00.000000Z",
        "renewTime": "2030-01-01T00:00:00.000000Z",
        "leaseTransitions": 4,
    }
    return {**spec, **changes}


# --- decisions ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_absent_lease_is_created_naming_the_candidate(store, elector) -> None:
    a = elector("a")
    assert await a.try_acquire_or_renew()
    assert a.leading
    spec = store.spec()
    assert spec["holderIdentity"] == "a"
    assert spec["leaseDurationSeconds"] == LEASE_DURATION_S == 15
    assert spec["leaseTransitions"] == 0
    assert MICROTIME.match(spec["acquireTime"]) and spec["acquireTime"] == spec["renewTime"]
    assert [(m, p) for _, m, p in store.requests] == [("GET", PATH), ("POST", COLLECTION)]


@pytest.mark.asyncio
async def test_own_lease_is_renewed_keeping_acquire_time_and_transitions(
    store, elector, time_
) -> None:
    a = elector("a")
    assert await a.try_acquire_or_renew()
    first = store.spec()
    version = store.leases[NAME]["metadata"]["resourceVersion"]
    await time_.advance(RETRY_PERIOD_S)
    assert await a.try_acquire_or_renew()
    renewed = store.spec()
    assert renewed["acquireTime"] == first["acquireTime"]
    assert renewed["leaseTransitions"] == first["leaseTransitions"]
    assert renewed["renewTime"] > first["renewTime"]
    assert store.leases[NAME]["metadata"]["resourceVersion"] != version
    assert store.requests[-1][1:] == ("PUT", PATH)


@pytest.mark.asyncio
async def test_a_live_foreign_lease_is_refused_without_a_write(store, elector, time_) -> None:
    store.write(NAME, foreign())
    b = elector("b")
    for _ in range(7):  # 14 s of tries: the lease stays live for 15 s after b first saw it
        assert not await b.try_acquire_or_renew()
        await time_.advance(RETRY_PERIOD_S)
    assert not b.leading and b.holder == "other_1"
    assert {(m, p) for _, m, p in store.requests} == {("GET", PATH)}
    assert store.spec() == foreign()


@pytest.mark.asyncio
async def test_an_unchanged_foreign_lease_expires_by_the_local_clock(store, elector, time_) -> None:
    # Its renewTime is long past by any wall clock; only this process's own clock counts,
    # from when it first saw the record.
    store.write(NAME, foreign(renewTime="2001-01-01T00:00:00.000000Z"))
    b = elector("b")
    assert not await b.try_acquire_or_renew()
    await time_.advance(LEASE_DURATION_S - 0.5)
    assert not await b.try_acquire_or_renew()
    await time_.advance(0.5)
    assert await b.try_acquire_or_renew()
    spec = store.spec()
    assert spec["holderIdentity"] == "b"
    assert spec["leaseTransitions"] == 5  # a change of holder
    assert spec["acquireTime"] == spec["renewTime"] != foreign()["acquireTime"]


@pytest.mark.asyncio
async def test_a_renewed_foreign_lease_stays_live(store, elector, time_) -> None:
    store.write(NAME, foreign())
    b = elector("b")
    assert not await b.try_acquire_or_renew()
    await time_.advance(10)
    store.write(NAME, foreign(renewTime="2030-01-01T00:00:10.000000Z"))  # the holder renews
    assert not await b.try_acquire_or_renew()
    await time_.advance(LEASE_DURATION_S - 0.5)  # 24.5 s after the first sight, 14.5 after
    assert not await b.try_acquire_or_renew()
    await time_.advance(0.5)
    assert await b.try_acquire_or_renew()


@pytest.mark.asyncio
async def test_the_records_own_duration_counts(store, elector, time_) -> None:
    store.write(NAME, foreign(leaseDurationSeconds=30))
    b = elector("b")
    assert not await b.try_acquire_or_renew()
    await time_.advance(29)
    assert not await b.try_acquire_or_renew()
    await time_.advance(1)
    assert await b.try_acquire_or_renew()


@pytest.mark.asyncio
async def test_a_concurrent_write_wins_and_the_loser_gets_409(store, elector, time_) -> None:
    store.write(NAME, foreign())
    a = elector("a")
    assert not await a.try_acquire_or_renew()
    await time_.advance(LEASE_DURATION_S)
    # Between a's read of the expired lease and its PUT, c takes it.
    store.after_get = lambda: store.write(NAME, foreign("c", leaseTransitions=5))
    assert not await a.try_acquire_or_renew()
    assert not a.leading
    assert store.spec()["holderIdentity"] == "c"
    assert store.requests[-1][1:] == ("PUT", PATH)


@pytest.mark.asyncio
async def test_two_creates_of_an_absent_lease_one_wins(store, elector) -> None:
    a = elector("a")
    # b creates it between a's read (404) and a's create.
    store.after_get = lambda: store.write(NAME, foreign("b", leaseTransitions=0))
    assert not await a.try_acquire_or_renew()
    assert not a.leading and store.spec()["holderIdentity"] == "b"


@pytest.mark.asyncio
async def test_release_clears_the_holder_and_a_follower_takes_over_at_once(
    store, elector, time_
) -> None:
    a, b = elector("a"), elector("b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # b has seen a's live lease
    assert await a.release()
    assert not a.leading
    released = store.spec()
    assert "holderIdentity" not in released
    assert released["leaseDurationSeconds"] == 1
    assert released["leaseTransitions"] == 0
    # No time passes: a lease without a holder is free.
    assert await b.try_acquire_or_renew()
    assert store.spec()["holderIdentity"] == "b"
    assert store.spec()["leaseTransitions"] == 1


@pytest.mark.asyncio
async def test_release_is_a_no_op_unless_leading_and_never_overwrites(store, elector) -> None:
    a = elector("a")
    assert not await a.release()
    assert store.requests == []
    assert await a.try_acquire_or_renew()
    store.write(NAME, foreign("c"))  # someone wrote after a's last renewal
    assert not await a.release()
    assert store.spec() == foreign("c")


def test_identity_is_the_pod_name_with_a_random_suffix_or_hostname_pid() -> None:
    first = default_identity({"POD_NAME": "op-7d9-x"})
    second = default_identity({"POD_NAME": "op-7d9-x"})
    assert first.startswith("op-7d9-x_") and second.startswith("op-7d9-x_") and first != second
    assert default_identity({}) == f"{socket.gethostname()}_{os.getpid()}"


# --- the loops: a follower's waits, a leader's renewals and their deadline ----------------


@pytest.mark.asyncio
async def test_a_follower_only_reads_the_lease_until_it_expires(store, elector, time_) -> None:
    store.write(NAME, foreign())
    b = elector("b")
    acquiring = asyncio.create_task(b.acquire())
    took = await time_.until("b to acquire", acquiring.done)
    await acquiring
    assert LEASE_DURATION_S <= took <= LEASE_DURATION_S + RETRY_PERIOD_S
    reads = [r for r in store.requests if r[1] == "GET"]
    assert len(reads) == len(store.requests) - 1  # one write: the takeover
    assert all(path == PATH for _, _, path in store.requests)
    assert len(reads) <= took / RETRY_PERIOD_S + 1


@pytest.mark.asyncio
async def test_a_leader_renews_every_retry_period(store, elector, time_) -> None:
    a = elector("a")
    assert await a.try_acquire_or_renew()
    leading = asyncio.create_task(a.keep_leading())
    await time_.advance(10 * RETRY_PERIOD_S + 0.5)
    assert not leading.done() and a.leading
    assert sum(1 for r in store.requests if r[1] == "PUT") == 10
    leading.cancel()


@pytest.mark.asyncio
async def test_a_leader_that_cannot_renew_stops_at_the_renew_deadline(
    store, elector, time_
) -> None:
    a = elector("a")
    assert await a.try_acquire_or_renew()
    renewed_at = time_.now
    leading = asyncio.create_task(a.keep_leading())
    await time_.advance(3 * RETRY_PERIOD_S + 0.5)
    store.down.add("a")
    last_renewal = 3 * RETRY_PERIOD_S + renewed_at
    await time_.until("a to stop leading", leading.done)
    assert not a.leading
    assert "no renewal within 10 s" in leading.result()
    assert last_renewal + RENEW_DEADLINE_S <= time_.now <= last_renewal + RENEW_DEADLINE_S + 0.2


@pytest.mark.asyncio
async def test_a_leader_that_reads_another_holder_stops_at_once(store, elector, time_) -> None:
    a = elector("a")
    assert await a.try_acquire_or_renew()
    leading = asyncio.create_task(a.keep_leading())
    await time_.advance(RETRY_PERIOD_S + 0.5)
    store.write(NAME, foreign("c"))
    took = await time_.until("a to stop leading", leading.done)
    assert took <= RETRY_PERIOD_S
    assert leading.result() == "the lease is held by c"


@pytest.mark.asyncio
async def test_a_renewal_with_no_answer_is_abandoned_at_the_deadline(store) -> None:
    # Real time, short timings: the request never returns, the deadline cuts it.
    a = LeaseElector(
        store.api("a"), NS, NAME, "a", lease_duration=3, renew_deadline=0.4, retry_period=0.1
    )
    assert await a.try_acquire_or_renew()
    store.hang.add("a")
    reason = await asyncio.wait_for(a.keep_leading(), timeout=10)
    assert "no answer" in reason or "deadline" in reason, reason
    assert not a.leading


@pytest.mark.asyncio
async def test_the_old_leader_stops_before_anyone_can_take_over(store, elector, time_) -> None:
    """A partitioned leader (its requests fail, the follower's go through): it stops leading
    at its renew deadline, before the follower's takeover, by at least the lease duration
    less the renew deadline less one retry period."""
    a, b = elector("a"), elector("b")
    assert await a.try_acquire_or_renew()
    leading = asyncio.create_task(a.keep_leading())
    following = asyncio.create_task(b.acquire())
    await time_.advance(5 * RETRY_PERIOD_S + 0.5)
    assert a.leading and not following.done()
    store.down.add("a")
    await time_.until("a to stop leading", leading.done)
    lost_at = time_.now
    await time_.until("b to take over", following.done)
    assert time_.now - lost_at >= LEASE_DURATION_S - RENEW_DEADLINE_S - RETRY_PERIOD_S
    assert b.leading and store.spec()["holderIdentity"] == "b"
    assert store.spec()["leaseTransitions"] == 1


# --- the entry point: options, and the flow around the elector -----------------------------


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        ([], {}, "-n/--namespace -A/--all-namespaces is required"),
        (["-A", "--namespace=x"], {}, "argument -n/--namespace: not allowed with"),
        (["-A", "--liveness=tcp://0.0.0.0:8080"], {}, "argument -L/--liveness"),
        (["-A", "--liveness=http://0.0.0.0:port/h"], {}, "argument -L/--liveness"),
        (["-A", "--lease-name=Bad_Name", "--lease-namespace=ns"], {}, "argument --lease-name"),
        (["-A", "--lease-name=l", "--lease-namespace=a.b"], {}, "argument --lease-namespace"),
        (["-A", "--lease-name=l"], {}, "--lease-name needs --lease-namespace"),
        (["-A", "--lease-name=l"], {"POD_NAMESPACE": "Bad"}, "POD_NAMESPACE"),
        (["-A", "--lease-namespace=ns"], {}, "--lease-namespace needs --lease-name"),
        (["-A", "--verbose", "--quiet"], {}, "argument -q/--quiet: not allowed with"),
        (["-A", "--standalone"], {}, "unrecognized arguments: --standalone"),
    ],
)
def test_invalid_options_exit_2_naming_the_option(
    argv: list[str], env: dict[str, str], named: str, capsys
) -> None:
    with pytest.raises(SystemExit) as exited:
        entry.parse_args(argv, env=env)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_the_charts_options_parse() -> None:
    options = entry.parse_args(
        ["--liveness=http://0.0.0.0:8080/healthz", "--lease-name=rel-arc-serving-operator",
         "--namespace=team-a", "--namespace=team-b", "--debug"],
        env={"POD_NAMESPACE": "arc-system"},
    )  # fmt: skip
    assert options.namespaces == ("team-a", "team-b") and not options.all_namespaces
    assert (options.lease_name, options.lease_namespace) == (NAME, "arc-system")
    assert options.debug and not options.verbose
    standalone = entry.parse_args(["-A"], env={"POD_NAMESPACE": "arc-system"})
    assert standalone.lease_name is None and standalone.lease_namespace is None


class FakeElector:
    """The elector as ``lead`` uses it: ``acquire`` returns once ``elected`` is set,
    ``keep_leading`` once ``lost`` is."""

    def __init__(self) -> None:
        self.elected, self.lost = asyncio.Event(), asyncio.Event()
        self.released = 0

    async def acquire(self) -> None:
        await self.elected.wait()

    async def keep_leading(self) -> str:
        await self.lost.wait()
        return "no renewal within 10 s"

    async def release(self) -> bool:
        self.released += 1
        return True


class FakeKopf:
    """Stands in for ``kopf.operator``: runs until its stop flag is set or ``finish`` is."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.finish = asyncio.Event()
        self.stop_flag: asyncio.Event | None = None

    async def run(
        self,
        options: entry.Options,
        stop_flag: asyncio.Event | None,
        ready_flag: asyncio.Event | None = None,
    ) -> None:
        self.stop_flag = stop_flag
        self.started.set()
        assert stop_flag is not None and ready_flag is not None
        ready_flag.set()
        stopped = asyncio.ensure_future(stop_flag.wait())
        finished = asyncio.ensure_future(self.finish.wait())
        await asyncio.wait({stopped, finished}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        finished.cancel()


async def eventually(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"{what} within {timeout} s"
        await asyncio.sleep(0.02)


async def health(url: str) -> int | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status
    except aiohttp.ClientConnectionError:
        return None


@pytest.fixture
def fake_kopf(monkeypatch: pytest.MonkeyPatch) -> FakeKopf:
    kopf = FakeKopf()
    monkeypatch.setattr(entry, "run_kopf", kopf.run)
    return kopf


def options_with_liveness() -> tuple[entry.Options, str]:
    url = f"http://127.0.0.1:{free_port()}/healthz"
    argv = ["-A", f"--liveness={url}", f"--lease-name={NAME}", f"--lease-namespace={NS}"]
    return entry.parse_args(argv, env={}), url


@pytest.mark.asyncio
async def test_a_follower_answers_healthz_then_the_leader_runs_kopf_and_releases_at_its_stop(
    fake_kopf: FakeKopf,
) -> None:
    options, url = options_with_liveness()
    elector = FakeElector()
    leading = asyncio.create_task(entry.lead(options, elector))  # type: ignore[arg-type]
    await eventually("the follower's /healthz", lambda: _is(health(url), 200))
    assert not fake_kopf.started.is_set()
    elector.elected.set()
    await asyncio.wait_for(fake_kopf.started.wait(), 10)
    # The follower's server is closed: kopf serves /healthz on that address now.
    assert await health(url) is None
    fake_kopf.finish.set()  # kopf stops as on SIGTERM (its own handlers)
    assert await asyncio.wait_for(leading, 10) == 0
    assert elector.released == 1


@pytest.mark.asyncio
async def test_a_lost_lease_stops_kopf_and_exits_1_without_a_release(fake_kopf: FakeKopf) -> None:
    options, _ = options_with_liveness()
    elector = FakeElector()
    elector.elected.set()
    leading = asyncio.create_task(entry.lead(options, elector))  # type: ignore[arg-type]
    await asyncio.wait_for(fake_kopf.started.wait(), 10)
    elector.lost.set()
    assert await asyncio.wait_for(leading, 10) == 1
    assert fake_kopf.stop_flag is not None and fake_kopf.stop_flag.is_set()
    assert elector.released == 0


@pytest.mark.asyncio
async def test_sigterm_stops_a_follower_with_0_and_no_kopf(fake_kopf: FakeKopf) -> None:
    options, url = options_with_liveness()
    elector = FakeElector()
    leading = asyncio.create_task(entry.lead(options, elector))  # type: ignore[arg-type]
    await eventually("the follower's /healthz", lambda: _is(health(url), 200))
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(leading, 10) == 0
    assert not fake_kopf.started.is_set()
    assert await health(url) is None


async def _is(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected
