"""Faults on a local fleet: two real vLLM CPU servers (plugin, ARC eviction) behind the real
vLLM router 0.1.17 with ``kv_aware`` routing, loaded by the real Locust replay through the
router (docs/architecture.md, "Routing").

What the router does, measured here:

- a restart of the router fails only the requests that met it while it was down; traffic
  resumes as soon as it answers ``/health`` again;
- a restarted router starts with an empty KV placement view and learns it from new events
  only: vLLM's replay endpoint still holds the earlier ``BlockStored`` events, but the router
  asks it for nothing but gaps in a stream it already follows, so a prefix cached before the
  restart is a placement miss afterwards, and one cached after it is a hit;
- a replica whose event stream is silent stays in the pool: its cached prefixes are
  placement misses, and requests spread over the replicas by load;
- with ``--kv-aware-session-affinity-ttl-secs``, every request of one ``X-Session-ID`` goes to
  the server its session's first request went to;
- a SIGKILLed replica fails only the streams it was serving at the kill; the router retries
  every later request that it sends there (connection refused) on the survivor.

One fleet serves the module (a vLLM start takes about a minute on two shared cores). The
tests run in file order with the kill last; ``ready_fleet`` brings a stopped server back (and
restarts the router) before a test that needs the whole fleet, and empties every cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from arc_harness.fleet import BLOCK_TOKENS, Fleet, FleetRouter, FleetServer
from arc_loadtest.run import ReplayRun
from tests.fleet.faults_fleet import (
    BackgroundReplay,
    docqa_trace,
    prompt,
    replayed_events,
    replayed_stores,
    result_rows,
    router_total,
    sources_with_silent,
    variant,
    worker_requests,
)

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow]

# Ports 27600-27699 are the fleet's (arc_harness.fleet); the second router and the silent event
# ports of the degraded-stream test use 27700-27799.
PORT_BASE = 27600
SILENT_ROUTER_PORT = 27700
SILENT_EVENT_PORT = 27710
A, B = 0, 1  # server indexes
LOOKUPS = "vllm_router_kv_placement_lookups_total"
RUNNING = "vllm_router_running_requests"
PRIMED_BLOCKS = 4
# Bounds for a slow, busy machine; every wait returns as soon as what it waits for is seen.
# A server's events: seen in its publisher's replay buffer, which holds what it has sent.
EVENT_TIMEOUT_S = 60.0
# A request's count: vLLM counts it just after it answers.
COUNTER_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    started = time.monotonic()
    with Fleet(model_dir, work_dir=work, port_base=PORT_BASE, policy="kv_aware",
               eviction="arc") as running:  # fmt: skip
        print(f"fleet of 2 up in {time.monotonic() - started:.1f} s (logs in {work})")
        yield running


@pytest.fixture
def ready_fleet(fleet: Fleet) -> Fleet:
    """Both servers up, the router up with kv_aware and every cache empty."""
    restarted = [server for server in fleet.servers if not server.running]
    for server in restarted:
        server.start()
    if restarted or not fleet.router.running or fleet.router.policy != "kv_aware":
        fleet.router.restart("kv_aware")
    # Each server queues AllBlocksCleared and publishes it with its next engine step, ahead
    # of that step's own events: the router's view of a server empties before it learns
    # anything new of it. The tests send fresh prompts, which no stale entry can match.
    fleet.reset_caches()
    return fleet


def wait_for_event(
    server: FleetServer, wanted: Callable[[dict[str, Any]], bool], what: str
) -> None:
    """Wait until a server's publisher has sent an event that ``wanted`` accepts: the router,
    which reads the same stream (polling its socket every 10 ms), gets it at the same time."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not any(wanted(event) for _, event in replayed_events(server.kv_replay_port)):
        assert time.monotonic() < deadline, f"server {server.index} published no {what}"
        time.sleep(0.1)


def lookups(router: FleetRouter) -> dict[str, float]:
    return {result: router_total(router, LOOKUPS, result=result) for result in ("hit", "miss")}


def routed(
    fleet: Fleet,
    tokens: list[int],
    router: FleetRouter | None = None,
    session: str | None = None,
) -> dict[str, Any]:
    """Send one request through a router (the fleet's by default), with ``X-Session-ID:
    session`` if given; returns which server answered it and the router's placement lookup
    for it."""
    router = router or fleet.router
    requests_before, hits_before = worker_requests(fleet), lookups(router)
    fleet.complete(tokens, url=router.url, session=session)
    deadline = time.monotonic() + COUNTER_TIMEOUT_S
    while True:  # vLLM counts a request just after it answers
        served = [after - before for before, after in
                  zip(requests_before, worker_requests(fleet), strict=True)]  # fmt: skip
        if sum(served) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sorted(served) == [0, 1], f"one request, answered by the servers as {served}"
    hits_after = lookups(router)
    return {
        "server": served.index(1),
        "lookup": {key: hits_after[key] - hits_before[key] for key in hits_after},
    }


def prime(fleet: Fleet, index: int, seed: int) -> list[int]:
    """Cache a fresh prefix on server ``index`` (sent to it directly, past the router)."""
    tokens = prompt(seed, PRIMED_BLOCKS)
    fleet.complete(tokens, url=fleet.servers[index].url)
    last = tuple(tokens[(PRIMED_BLOCKS - 1) * BLOCK_TOKENS : PRIMED_BLOCKS * BLOCK_TOKENS])

    def stores_last_block(event: dict[str, Any]) -> bool:
        stored = event.get("token_ids") or []
        return event["type"] == "BlockStored" and any(
            tuple(stored[at : at + BLOCK_TOKENS]) == last
            for at in range(0, len(stored), BLOCK_TOKENS)
        )

    wait_for_event(fleet.servers[index], stores_last_block, "BlockStored of the primed prefix")
    return tokens


def timeline(rows: list[dict[str, Any]], moment: float) -> list[str]:
    """Rows as "index: sent .. ended (relative to ``moment``), outcome", for messages."""
    return [
        f"{row['index']}: {row['sent_wall'] - moment:+.3f} .. "
        f"{row['sent_wall'] + row['e2e_s'] - moment:+.3f} s, "
        f"{'ok' if row['ok'] else row['error']}"
        for row in rows
    ]


def check_summary(run: ReplayRun, failed: list[dict[str, Any]], kinds: dict[str, int]) -> None:
    """The load test's summary and printed report agree with the rows: ``failed`` requests,
    of the ``kinds`` given (arc_loadtest.report: in flight, refused, gateway, error)."""
    summary = run.summary
    assert summary is not None, run.log[-3000:]
    assert summary["requests_failed"] == len(failed) == sum(kinds.values())
    assert summary["failures"] == {"in_flight": 0, "refused": 0, "gateway": 0, "error": 0} | kinds
    assert summary["requests_failed_in_flight"] == kinds.get("in_flight", 0)
    assert f"requests: {summary['requests_ok']} ok, {len(failed)} failed" in run.log
    if failed:
        listed = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in kinds.items()
                           if count)  # fmt: skip
        assert f"failed requests: {listed}" in run.log, run.log[-3000:]
    assert run.exit_code == (1 if failed else 0), run.log[-3000:]


def test_router_restart_fails_only_requests_that_met_it_down(
    ready_fleet: Fleet, model_dir: Path, tmp_path: Path
) -> None:
    fleet = ready_fleet
    # The load is sized from a restart timed on this machine: requests at least a quarter of
    # it apart (and no more than 4 every 3 s), so that a restart up to twice as slow leaves
    # fewer than the 10 unanswered requests in a row after which the load test gives up
    # (--max-unreachable).
    began = time.monotonic()
    fleet.router.restart()
    spacing_s = max(0.75, (time.monotonic() - began) / 4)
    trace = docqa_trace(tmp_path / "trace.jsonl", requests=32, spacing_s=spacing_s,
                        output_tokens=8)  # fmt: skip
    before = sum(worker_requests(fleet))
    replay = BackgroundReplay(fleet, trace, tmp_path / "out", model_dir).start()
    deadline = time.monotonic() + replay.run_time_s
    while sum(worker_requests(fleet)) - before < 8:
        assert replay.alive and time.monotonic() < deadline, "the replay never got going"
        time.sleep(0.2)
    down = time.time()
    fleet.router.stop()  # SIGTERM: the router drains what it serves, then exits
    stopped = time.time()
    fleet.router.start()
    back = time.time()  # it answers /health again
    run = replay.join()

    summary = run.summary
    assert summary is not None, run.log[-3000:]
    rows = result_rows(run)
    failed = [row for row in rows if not row["ok"]]
    assert summary["stopped_early"] is None, summary["stopped_early"]
    assert summary["requests_ok"] + summary["requests_failed"] == summary["requests_planned"]
    # Refused while nothing listened, or cut in flight by the stopping router.
    kinds = {kind: sum(1 for row in failed if row["failure"] == kind)
             for kind in ("in_flight", "refused")}  # fmt: skip
    check_summary(run, failed, kinds)
    # Only requests that overlapped the router's absence failed ...
    overlapped = [row for row in failed if row["sent_wall"] <= back
                  and row["sent_wall"] + row["e2e_s"] >= down]  # fmt: skip
    assert overlapped == failed, timeline(failed, down)
    # ... and everything sent once it answered again succeeded.
    after = [row for row in rows if row["sent_wall"] > back]
    assert after and all(row["ok"] for row in after), timeline(after, down)
    recovered = min(row["sent_wall"] + row["e2e_s"] for row in rows
                    if row["ok"] and row["sent_wall"] >= down)  # fmt: skip
    print(
        f"router restart: stop {stopped - down:.2f} s, start {back - stopped:.2f} s; "
        f"{len(failed)} of {len(rows)} requests failed {kinds}; first answer "
        f"{recovered - down:.2f} s after the stop began"
    )


def cache_until_placed(fleet: Fleet, seed: int) -> tuple[list[int], list[dict[str, Any]]]:
    """Cache fresh prefixes on server B until the router places one by its events; the last
    prefix and every attempt. A router started moments ago (or restarted: its subscriptions
    are new) gets only what is published after its ZMQ subscription takes effect, so a
    prefix cached before that is unknown to it."""
    deadline = time.monotonic() + COUNTER_TIMEOUT_S
    attempts: list[dict[str, Any]] = []
    while not attempts or attempts[-1]["lookup"]["hit"] != 1:
        assert time.monotonic() < deadline, f"no freshly cached prefix was placed: {attempts}"
        tokens = prime(fleet, B, seed=seed + len(attempts))
        attempts.append(routed(fleet, variant(tokens, 1)))
    assert attempts[-1] == {"server": B, "lookup": {"hit": 1, "miss": 0}}, attempts
    return tokens, attempts


def test_restarted_router_learns_placement_from_new_events_only(ready_fleet: Fleet) -> None:
    fleet = ready_fleet
    before_restart, _ = cache_until_placed(fleet, seed=101)
    # The publisher's replay buffer still holds the blocks (a router could rebuild from it).
    stored = {store.token_ids[: len(before_restart) - 1] for store in
              replayed_stores(fleet.servers[B].kv_replay_port)}  # fmt: skip
    assert tuple(before_restart[:-1]) in stored

    fleet.router.restart()
    forgotten = routed(fleet, variant(before_restart, 2))
    # vllm-router 0.1.17 replays only to fill a gap in a stream it follows, never at start.
    # If this turns into a hit, the router learned to rebuild its view: update the Routing
    # section of docs/architecture.md.
    assert forgotten["lookup"] == {"hit": 0, "miss": 1}, forgotten
    _, attempts = cache_until_placed(fleet, seed=201)
    print(f"router restart: prefix cached before it went to server {forgotten['server']} "
          f"(placement miss); one cached after it went to server {B} (hit, "
          f"{len(attempts)} prefix(es) cached until the router's subscription took)")  # fmt: skip


def test_silent_event_stream_degrades_to_load_balancing(ready_fleet: Fleet, tmp_path: Path) -> None:
    fleet = ready_fleet
    router = FleetRouter(
        sources_with_silent(fleet, B, SILENT_EVENT_PORT),  # type: ignore[arg-type]
        port=SILENT_ROUTER_PORT, policy="kv_aware", api_key=fleet.api_key,
        log_path=tmp_path / "silent-router.log",
    )  # fmt: skip
    router.start()
    try:
        on_a, on_b = prime(fleet, A, seed=201), prime(fleet, B, seed=202)
        # The live stream still steers: A's prefix goes to A.
        assert routed(fleet, variant(on_a, 1), router) == {
            "server": A, "lookup": {"hit": 1, "miss": 0}
        }  # fmt: skip
        # B's prefix is unknown to this router: a miss, placed by load like any new prompt.
        assert routed(fleet, variant(on_b, 1), router)["lookup"] == {"hit": 0, "miss": 1}

        before = worker_requests(fleet)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda seed: fleet.complete(prompt(seed, 2), max_tokens=16,
                                                      url=router.url),
                          range(300, 316)))  # fmt: skip
        deadline = time.monotonic() + COUNTER_TIMEOUT_S
        while True:  # vLLM counts a request just after it answers
            spread = [after - start for start, after in zip(before, worker_requests(fleet),
                                                             strict=True)]  # fmt: skip
            if sum(spread) >= 16 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sum(spread) == 16 and min(spread) >= 1, spread
        health = {labels["worker"]: value for labels, value in
                  router.metrics().get("vllm_router_worker_health", [])}  # fmt: skip
        assert health == {server.url: 1.0 for server in fleet.servers}, health
        print(f"silent stream of server {B}: 16 new prompts split {spread} over the servers")
    finally:
        router.stop()


def test_session_affinity_keeps_a_session_on_its_server_whatever_the_costs(
    ready_fleet: Fleet,
) -> None:
    """``--kv-aware-session-affinity-ttl-secs`` keys on ``X-Session-ID``, as the simulator's
    ``kv_aware`` models it (docs/routing.md, "kv_aware details"). At a temperature that makes
    every cost-based choice a coin toss, one session's cold prompts all go to one server, and
    distinct sessions' spread (each outcome has odds of 1 in 2,048 by chance)."""
    fleet = ready_fleet
    plain_args = list(fleet.router.extra_args)
    coin_toss = ["--router-temperature", "1e12"]
    fleet.router.restart(
        "kv_aware", [*plain_args, *coin_toss, "--kv-aware-session-affinity-ttl-secs", "600"]
    )
    try:
        one_session = {routed(fleet, prompt(700 + n), session="one")["server"] for n in range(12)}
        distinct = {routed(fleet, prompt(800 + n), session=f"s{n}")["server"] for n in range(12)}
    finally:
        fleet.router.restart("kv_aware", plain_args)
    assert len(one_session) == 1
    assert distinct == {A, B}


def test_killed_replica_fails_only_its_in_flight_streams(
    ready_fleet: Fleet, model_dir: Path, tmp_path: Path
) -> None:
    fleet = ready_fleet
    # One prefix cached on each server: the router's view keeps placing it there after a kill.
    stale = [prime(fleet, server.index, seed=401 + server.index) for server in fleet.servers]
    # 4 requests/s of 48 output tokens: several streams are in flight on each server.
    trace = docqa_trace(tmp_path / "trace.jsonl", requests=120, spacing_s=0.25,
                        output_tokens=48, seed=1)  # fmt: skip
    answered = sum(worker_requests(fleet))
    replay = BackgroundReplay(fleet, trace, tmp_path / "out", model_dir).start()
    deadline = time.monotonic() + replay.run_time_s
    while sum(worker_requests(fleet)) - answered < 10:
        assert replay.alive and time.monotonic() < deadline, "the replay never got going"
        time.sleep(0.2)
    while True:
        assert replay.alive and time.monotonic() < deadline, "no stream in flight to cut"
        read = time.time()
        running = [router_total(fleet.router, RUNNING, worker=server.url)
                   for server in fleet.servers]  # fmt: skip
        if max(running) >= 1:
            break
        time.sleep(0.05)
    victim = max(fleet.servers, key=lambda server: (running[server.index], server.index))
    survivor = fleet.servers[1 - victim.index]
    serving = running[victim.index]
    kill_began = time.time()
    victim.kill()
    killed = time.time()  # the group is dead and reaped
    run = replay.join()

    summary = run.summary
    assert summary is not None, run.log[-3000:]
    rows = result_rows(run)
    failed = [row for row in rows if not row["ok"]]
    # The router kept the replay alive: no early stop, every request sent and answered.
    assert summary["stopped_early"] is None, summary["stopped_early"]
    assert summary["requests_sent"] == summary["requests_planned"] == len(rows)
    # Every failure is a stream cut in flight: the router retried what the dead server refused.
    check_summary(run, failed, {"in_flight": len(failed)})
    # Failures are streams cut by the kill, no more than the router had running on the victim
    # when it was read, plus requests sent between that reading and the end of the kill.
    cut = [row for row in failed if row["sent_wall"] <= killed
           and row["sent_wall"] + row["e2e_s"] >= kill_began]  # fmt: skip
    assert cut == failed, timeline(failed, kill_began)
    late = sum(1 for row in rows if read <= row["sent_wall"] <= killed)
    assert len(failed) <= serving + late, (timeline(failed, kill_began), serving, late)
    after = [row for row in rows if row["sent_wall"] > killed]
    assert after and all(row["ok"] for row in after), timeline(after, kill_began)

    # The view still places this prefix on the dead server: the survivor answers it.
    retries = router_total(fleet.router, "vllm_router_retries_total")
    served = survivor.stats().requests or 0.0
    for tag in range(5):
        fleet.complete(variant(stale[victim.index], tag))
    assert survivor.stats().requests == served + 5
    first_ok = min(row["sent_wall"] + row["e2e_s"] - killed for row in after)
    attempts = router_total(fleet.router, "vllm_router_cb_outcomes_total", worker=victim.url,
                            outcome="failure")  # fmt: skip
    circuit = router_total(fleet.router, "vllm_router_cb_state", worker=victim.url)
    print(
        f"kill of server {victim.index}: {len(failed)} of {len(rows)} requests failed "
        f"({serving:.0f} running on it at the kill), all {len(after)} sent later succeeded, "
        f"the first answered {first_ok:.2f} s after the kill; the router sent {attempts:.0f} "
        f"attempts to the dead server (each retried), circuit state {circuit:.0f}; "
        f"stale-prefix requests retried "
        f"{router_total(fleet.router, 'vllm_router_retries_total') - retries:.0f} times"
    )
