"""Pure tests of /metrics parsing, the hit rate and the condition roll-up."""

from __future__ import annotations

from dataclasses import replace

import pytest

from arc_operator.metrics import MetricsError, PodMetrics, hit_rate, parse_metrics, pod_hit_rates
from arc_operator.models import parse_spec
from arc_operator.status import Observation, Rollout, build_status, status_patch
from tests.operator.conftest import make_spec, metrics_text

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def observe(
    spec=None,
    *,
    error=None,
    ready=1,
    scraped=None,
    unreachable=0,
    rate=None,
    error_reason="InvalidSpec",
):
    return Observation(
        error_reason=error_reason,
        generation=3,
        spec=spec,
        error=error,
        rollout=Rollout(replicas=ready, ready=ready, updated=ready),
        scraped=scraped or {},
        unreachable=unreachable,
        hit_rate=rate,
    )


def pods(*policies: str) -> dict[str, PodMetrics]:
    return {f"p{i}": PodMetrics(frozenset({p}), 0, 0) for i, p in enumerate(policies)}


def conditions(status) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status.value, c.reason) for c in status.conditions}


def test_parse_metrics_reads_policy_and_prefix_counters() -> None:
    reading = parse_metrics(metrics_text("arc", hits=30, queries=40))
    assert reading == PodMetrics(frozenset({"arc"}), 30.0, 40.0)
    assert parse_metrics(metrics_text(None, 0, 0)).policies == frozenset()


def test_malformed_metrics_text_is_an_error() -> None:
    with pytest.raises(MetricsError):
        parse_metrics("vllm:prefix_cache_hits_total{engine=0 1\n")


def test_hit_rate_is_over_the_interval_and_survives_a_counter_reset() -> None:
    before = {"a": PodMetrics(frozenset(), 100, 200), "b": PodMetrics(frozenset(), 50, 100)}
    after = {"a": PodMetrics(frozenset(), 130, 240), "b": PodMetrics(frozenset(), 10, 60)}
    # a: +30/+40; b restarted: counts from zero, 10/60.
    assert hit_rate(before, after) == pytest.approx(40 / 100)
    assert hit_rate({}, after) is None
    assert hit_rate(after, after) is None


def test_ready_when_valid_rolled_out_and_policy_active() -> None:
    spec = parse_spec(make_spec(policy="ARC", replicas=2, routing={"policy": "none"}))
    status = build_status(observe(spec, ready=2, scraped=pods("arc", "arc"), rate=0.5), None, NOW)
    assert conditions(status) == {
        "Valid": ("True", "SpecValid"),
        "PolicyApplied": ("True", "PolicyActive"),
        "Ready": ("True", "Ready"),
    }
    assert (status.phase.value, status.active_policy, status.hit_rate) == ("Ready", "ARC", 0.5)


def test_ready_copies_the_first_failing_dependency() -> None:
    spec = parse_spec(make_spec(policy="ARC", replicas=2, routing={"policy": "none"}))
    switching = build_status(observe(spec, ready=2, scraped=pods("arc", "lru")), None, NOW)
    assert conditions(switching)["Ready"] == ("False", "Switching")
    assert switching.active_policy == "ARC,LRU"
    rolling = build_status(observe(spec, ready=1, scraped=pods("lru")), None, NOW)
    assert conditions(rolling)["Ready"] == ("False", "RolloutInProgress")
    unknown = build_status(observe(spec, ready=2, unreachable=2), None, NOW)
    assert conditions(unknown)["Ready"] == ("Unknown", "MetricsUnavailable")


def test_invalid_spec_rolls_up_to_not_ready() -> None:
    status = build_status(observe(error="spec.replicas: bad"), None, NOW)
    assert conditions(status)["Valid"] == ("False", "InvalidSpec")
    assert conditions(status)["Ready"] == ("False", "InvalidSpec")
    assert status.phase.value == "Invalid"


def test_transition_time_moves_only_when_status_changes() -> None:
    spec = parse_spec(make_spec(policy="ARC"))
    first = build_status(observe(spec, scraped=pods("arc")), None, NOW)
    previous = {"conditions": [c.model_dump(by_alias=True) for c in first.conditions]}
    same = build_status(observe(spec, scraped=pods("arc")), previous, LATER)
    assert {c.last_transition_time for c in same.conditions} == {NOW}
    changed = build_status(observe(spec, scraped=pods("lru")), previous, LATER)
    times = {c.type: c.last_transition_time for c in changed.conditions}
    assert times == {"Valid": NOW, "PolicyApplied": LATER, "Ready": LATER}


def test_scaled_to_zero_is_stopped() -> None:
    status = build_status(observe(parse_spec(make_spec(replicas=0)), ready=0), None, NOW)
    assert status.phase.value == "Stopped"
    assert conditions(status)["Ready"] == ("False", "ScaledToZero")


def test_rollout_is_incomplete_until_the_controller_observes_the_new_template() -> None:
    counts = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    stale = {"metadata": {"generation": 4}, "status": {**counts, "observedGeneration": 3}}
    current = {"metadata": {"generation": 4}, "status": {**counts, "observedGeneration": 4}}
    assert not Rollout.from_deployment(stale).complete(2)
    assert Rollout.from_deployment(current).complete(2)

    spec = parse_spec(make_spec(policy="ARC", replicas=2, routing={"policy": "none"}))
    seen = observe(spec, ready=2, scraped=pods("arc", "arc"))
    stale_status = build_status(replace(seen, rollout=Rollout.from_deployment(stale)), None, NOW)
    ready = next(c for c in stale_status.conditions if c.type == "Ready")
    assert (ready.status.value, ready.reason) == ("False", "RolloutInProgress")
    assert "not yet observed generation 4" in ready.message
    assert stale_status.phase.value == "Progressing"


def test_a_rejected_child_reads_as_apply_rejected() -> None:
    status = build_status(
        observe(error="Kubernetes API error 422: quota", error_reason="ApplyRejected"), None, NOW
    )
    assert conditions(status) == {
        "Valid": ("False", "ApplyRejected"),
        "PolicyApplied": ("False", "ApplyRejected"),
        "Ready": ("False", "ApplyRejected"),
    }
    assert status.conditions[0].message == "Kubernetes API error 422: quota"
    assert status.phase.value == "Invalid"


# --- routing: RouterReady, routingPolicy, replicaHitRates -------------------------------------


def routed_status(policy: str, router: Rollout, desired: int, **seen: object):
    spec = parse_spec(make_spec(policy="ARC", replicas=2, routing={"policy": policy}))
    observation = replace(
        observe(spec, ready=2, scraped=pods("arc", "arc")),
        router=router,
        router_desired=desired,
        **seen,
    )
    return build_status(observation, None, NOW)


def test_router_ready_follows_the_router_rollout_and_gates_ready() -> None:
    waiting = routed_status("kv_aware", Rollout(), 0)
    assert conditions(waiting)["RouterReady"] == ("False", "NoReadyServingPods")
    assert conditions(waiting)["Ready"] == ("False", "NoReadyServingPods")
    rolling = routed_status("round_robin", Rollout(replicas=2, ready=1, updated=1), 2)
    assert conditions(rolling)["RouterReady"] == ("False", "RolloutInProgress")
    assert conditions(rolling)["Ready"] == ("False", "RolloutInProgress")
    assert "1 ready and 1 updated of 2 desired router pods" in rolling.conditions[2].message
    ready = routed_status("kv_aware", Rollout(replicas=1, ready=1, updated=1), 1)
    assert [c.type for c in ready.conditions] == ["Valid", "PolicyApplied", "RouterReady", "Ready"]
    assert conditions(ready)["RouterReady"] == ("True", "RouterReady")
    assert conditions(ready)["Ready"] == ("True", "Ready")
    assert (ready.routing_policy, ready.phase.value) == ("kv_aware", "Ready")


def test_without_a_router_or_a_valid_spec_there_is_no_router_condition() -> None:
    none = routed_status("none", Rollout(), 0)
    assert "RouterReady" not in conditions(none) and none.routing_policy == "none"
    assert conditions(none)["Ready"] == ("True", "Ready")
    invalid = build_status(observe(error="spec.routing.policy: bad"), None, NOW)
    assert "RouterReady" not in conditions(invalid) and invalid.routing_policy is None
    # The default: kv_aware with more than one replica, none with one.
    one = build_status(observe(parse_spec(make_spec()), scraped=pods("lru")), None, NOW)
    assert one.routing_policy == "none"


def test_each_pods_hit_rate_is_its_own_over_the_interval() -> None:
    before = {"a": PodMetrics(frozenset(), 100, 200), "b": PodMetrics(frozenset(), 50, 100)}
    after = {
        "a": PodMetrics(frozenset(), 130, 240),  # 30 of 40
        "b": PodMetrics(frozenset(), 50, 100),  # no query: no rate
        "c": PodMetrics(frozenset(), 5, 10),  # read once: not yet
    }
    assert pod_hit_rates(before, after) == {"a": pytest.approx(0.75), "b": None}
    status = routed_status(
        "kv_aware",
        Rollout(replicas=1, ready=1, updated=1),
        1,
        replica_hit_rates=pod_hit_rates(before, after),
    )
    assert status_patch(status)["replicaHitRates"] == [
        {"pod": "a", "hitRate": pytest.approx(0.75)},
        {"pod": "b"},
    ]
    assert status_patch(status)["routingPolicy"] == "kv_aware"


def test_hit_rates_are_stored_to_four_decimals() -> None:
    """kubectl prints the HIT RATE column as stored."""
    status = routed_status(
        "kv_aware",
        Rollout(replicas=1, ready=1, updated=1),
        1,
        hit_rate=0.5741566549498976,
        replica_hit_rates={"a": 2 / 3, "b": None},
    )
    patch = status_patch(status)
    assert patch["hitRate"] == 0.5742
    assert patch["replicaHitRates"] == [{"pod": "a", "hitRate": 0.6667}, {"pod": "b"}]
