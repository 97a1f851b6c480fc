"""The simulator's ``kv_aware`` rule against the real router's recorded decisions.

Each file under ``data/`` is the ``decisions.jsonl`` of one ``kv_aware`` replay of
``make demo-fleet --record-decisions`` (two vLLM CPU servers with the plugin behind
vllm-router 0.1.17, the demo's 117-request trace): per request, the worker the router chose
and the prefix it credited (its debug log), and the state around the moment it was sent,
rebuilt from the servers' own KV-event streams and the replay's timings
(``arc_dev.fleet_decisions``). The rule is ``arc_simulator.routing.prefix_cost``, the one
``KvAwareRouter`` scores with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from arc_dev.fleet_decisions import Cost, Decision, read_decisions
from arc_simulator.routing import prefix_cost

RECORDS = sorted((Path(__file__).parent / "data").glob("kv-aware-decisions-*.jsonl"))


@pytest.fixture(params=RECORDS, ids=[path.stem for path in RECORDS])
def decisions(request: pytest.FixtureRequest) -> list[Decision]:
    return read_decisions(request.param)


def test_there_are_recorded_runs_of_both_eviction_policies() -> None:
    assert [path.stem for path in RECORDS] == ["kv-aware-decisions-lru", "kv-aware-decisions-trio"]


def unexplained(decisions: list[Decision], cost: Cost) -> list[int]:
    return [decision.index for decision in decisions if not decision.explained(cost)]


def test_the_simulators_rule_makes_the_routers_decisions(decisions: list[Decision]) -> None:
    # One in a hundred may combine two changes the router saw in the other order than the
    # recording (a request's end and another's, tens of milliseconds apart).
    assert len(unexplained(decisions, prefix_cost)) <= len(decisions) // 100
    # At the load test's own stamps, without the window, nearly all of them already.
    agree = sum(decision.agrees() for decision in decisions)
    assert agree >= 0.95 * len(decisions)


def test_the_router_credits_what_its_worker_had_published(decisions: list[Decision]) -> None:
    matches = sum(decision.credit_matches for decision in decisions)
    assert matches >= 0.98 * len(decisions)
    # And prefixes were there to credit, on both servers.
    credited = {d.worker for d in decisions if d.router_credited_tokens > 0}
    assert credited == {0, 1}


def test_ties_are_drawn(decisions: list[Decision]) -> None:
    """At the operator's temperature 1 the router draws between servers of equal cost: both
    servers won ties (at temperature 0 the first registered one would win them all)."""
    tied = [decision for decision in decisions if len(decision.rule()) > 1]
    assert len(tied) >= 10
    assert {decision.worker for decision in tied} == {0, 1}


def no_in_flight_prefill(new: int, in_flight: int, load: int) -> int:
    return new * (load + 1)


def load_without_the_new_request(new: int, in_flight: int, load: int) -> int:
    return (new + in_flight) * load


def prefix_only(new: int, in_flight: int, load: int) -> int:
    return new


def load_only(new: int, in_flight: int, load: int) -> int:
    return load


@pytest.mark.parametrize(
    "cost", [no_in_flight_prefill, load_without_the_new_request, prefix_only, load_only]
)
def test_a_rule_without_one_of_its_terms_does_not(decisions: list[Decision], cost: Cost) -> None:
    """The records tell the router's rule from these: each leaves several decisions no state
    of their window explains."""
    assert len(unexplained(decisions, cost)) >= 3
