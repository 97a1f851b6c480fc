"""A ServingPolicy's status: its model (the CRD's status schema) and how it is built from
what the operator observed (pure functions).

Conditions, rolled up the way KServe (knative's ConditionSet) does: ``Ready`` is the happy
condition and depends on ``Valid``, the Deployment's rollout, ``PolicyApplied`` and, when a
router runs, ``RouterReady``, checked in that order. Ready is True only when every dependency
holds; otherwise it copies the reason and message of the first dependency that is False, or,
if none is False, of the first that is Unknown. ``lastTransitionTime`` moves only when a
condition's status changes.

- ``Valid``: the spec passed validation (False: reason ``InvalidSpec``, nothing running was
  changed; or ``ApplyRejected``, the API server refused a child built from it, with its
  message).
- ``PolicyApplied``: every ready pod reports the spec's policy on /metrics (True:
  ``PolicyActive``; False: ``Switching`` while pods differ, or ``InvalidSpec``; Unknown:
  ``NoReadyPods``, or ``MetricsUnavailable`` when a ready pod's /metrics could not be read;
  True ``NoReplicas`` at 0 replicas; False with Valid's reason when Valid is False).
- ``RouterReady`` (only while the routing policy is not none and the spec is valid): True
  (``RouterReady``) when the router Deployment has every replica ready; False
  ``RolloutInProgress`` until then, or ``NoReadyServingPods`` while a kv_aware router has no
  ready serving pod to route to (its Deployment is at 0 replicas).
- ``Ready``: see above; at 0 replicas it is False with reason ``ScaledToZero``.

``routingPolicy`` is the effective routing policy (also when defaulted) and
``replicaHitRates`` each read pod's own hit rate over the interval, next to the summed
``hitRate``; both rounded to ``HIT_RATE_DIGITS`` decimals.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from arc_operator.metrics import PodMetrics
from arc_operator.models import RoutingPolicy, ServingPolicySpec
from arc_operator.models.base import FrozenModel

VALID, POLICY_APPLIED, ROUTER_READY, READY = "Valid", "PolicyApplied", "RouterReady", "Ready"
# kubectl prints the HIT RATE column as stored: more digits are noise over one interval.
HIT_RATE_DIGITS = 4
INVALID_SPEC, APPLY_REJECTED = "InvalidSpec", "ApplyRejected"


class ConditionStatus(enum.StrEnum):
    """Kubernetes condition status values."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Phase(enum.StrEnum):
    """One-word summary of a ServingPolicy; the conditions carry the detail."""

    PROGRESSING = "Progressing"  # children applied; pods rolling out or switching policy
    READY = "Ready"  # every pod ready and reporting the spec's policy
    STOPPED = "Stopped"  # replicas is 0
    INVALID = "Invalid"  # the spec is invalid; running pods are left as they were


class Condition(FrozenModel):
    """One status condition; lastTransitionTime changes only when status changes."""

    type: str = Field(description="Valid, PolicyApplied, RouterReady or Ready.")
    status: ConditionStatus
    reason: str = Field(description="CamelCase reason.")
    message: str = ""
    last_transition_time: str = Field(
        json_schema_extra={"format": "date-time"}, description="RFC 3339 time."
    )
    observed_generation: int | None = None


class ReplicaHitRate(FrozenModel):
    """One serving pod's own prefix-cache hit rate over the last status interval."""

    pod: str = Field(description="Serving pod name.")
    hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Hit rate (tokens) of this pod; absent when it had no queries.",
    )


class ServingPolicyStatus(FrozenModel):
    """What the operator observed; written by every reconcile and by the status timer."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation of the spec last reconciled."
    )
    phase: Phase = Field(description="Summary of the conditions.")
    replicas: int = Field(default=0, description="Pods the Deployment has.")
    ready_replicas: int = Field(default=0, description="Pods passing their readiness probe.")
    active_policy: str | None = Field(
        default=None,
        description="Policy the pods report on /metrics (comma-separated while they differ).",
    )
    hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Prefix-cache hit rate (tokens) over the last status interval.",
    )
    routing_policy: str | None = Field(
        default=None,
        description="Routing policy in effect (routing.policy or its default); absent while "
        "the spec is invalid.",
    )
    replica_hit_rates: list[ReplicaHitRate] = Field(
        default_factory=list,
        description="Each read serving pod's own hit rate over the last status interval.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


@dataclass(frozen=True, slots=True)
class Rollout:
    """The Deployment's progress, from its status (all zero before it exists).

    ``generation`` is the Deployment's ``metadata.generation`` and ``observed`` its
    ``status.observedGeneration``: until the controller has observed the latest template,
    the counts describe the previous one.
    """

    replicas: int = 0
    ready: int = 0
    updated: int = 0
    generation: int = 0
    observed: int = 0

    @classmethod
    def from_deployment(cls, deployment: Mapping[str, Any] | None) -> Rollout:
        """Read ``status.replicas``, ``readyReplicas``, ``updatedReplicas`` and the
        generations."""
        deployment = deployment or {}
        status = deployment.get("status") or {}
        return cls(
            replicas=int(status.get("replicas") or 0),
            ready=int(status.get("readyReplicas") or 0),
            updated=int(status.get("updatedReplicas") or 0),
            generation=int((deployment.get("metadata") or {}).get("generation") or 0),
            observed=int(status.get("observedGeneration") or 0),
        )

    @property
    def observed_latest(self) -> bool:
        """The controller has seen the current template (as ``kubectl rollout status``)."""
        return self.observed >= self.generation

    def complete(self, desired: int) -> bool:
        """The controller saw the current template, every desired pod runs it and is
        ready, and no old pod is left."""
        return (
            self.observed_latest
            and self.updated == desired
            and self.ready >= desired
            and self.replicas == desired
        )


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one status pass saw. ``scraped`` maps ready pods to their readings;
    ``unreachable`` counts ready pods whose /metrics could not be read. ``spec`` is None
    exactly when ``error`` says why the spec was not acted on (``error_reason``:
    ``InvalidSpec`` or ``ApplyRejected``). ``router`` is the router Deployment's rollout and
    ``router_desired`` the replicas it was given (read only while a router runs);
    ``replica_hit_rates`` maps pods read twice to their own rate."""

    generation: int | None
    spec: ServingPolicySpec | None
    error: str | None
    rollout: Rollout
    scraped: Mapping[str, PodMetrics]
    unreachable: int
    hit_rate: float | None
    error_reason: str = INVALID_SPEC
    router: Rollout = Rollout()
    router_desired: int = 0
    replica_hit_rates: Mapping[str, float | None] = field(default_factory=dict)


def _condition(
    previous: Sequence[Mapping[str, Any]],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> Condition:
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def _policy_applied(seen: Observation) -> tuple[ConditionStatus, str, str]:
    spec = seen.spec
    if spec is None:
        return (
            ConditionStatus.FALSE,
            seen.error_reason,
            "the spec was not applied; pods keep their previous policy",
        )
    wanted = spec.policy_name
    if spec.replicas == 0:
        return (
            ConditionStatus.TRUE,
            "NoReplicas",
            f"no pods; the policy ConfigMap holds {wanted}",
        )
    if not seen.scraped and not seen.unreachable:
        return ConditionStatus.UNKNOWN, "NoReadyPods", "no pod is ready yet"
    if not seen.scraped:
        return (
            ConditionStatus.UNKNOWN,
            "MetricsUnavailable",
            f"no ready pod's /metrics could be read ({seen.unreachable} unreachable)",
        )
    reported = Counter(",".join(sorted(m.policies)) or "none" for m in seen.scraped.values())
    agreeing = reported.pop(wanted, 0)
    if reported:
        others = ", ".join(f"{name} on {count}" for name, count in sorted(reported.items()))
        return (
            ConditionStatus.FALSE,
            "Switching",
            f"{agreeing} of {len(seen.scraped)} read pods report {wanted}; {others}",
        )
    if seen.unreachable:
        return (
            ConditionStatus.UNKNOWN,
            "MetricsUnavailable",
            f"{agreeing} pods report {wanted}; {seen.unreachable} could not be read",
        )
    return ConditionStatus.TRUE, "PolicyActive", f"all {agreeing} ready pods report {wanted}"


def _router_ready(seen: Observation) -> tuple[ConditionStatus, str, str] | None:
    """RouterReady's verdict; None (no condition) without a valid spec or a router."""
    if seen.spec is None or seen.spec.routing_policy is RoutingPolicy.NONE:
        return None
    policy, desired, r = seen.spec.routing_policy.value, seen.router_desired, seen.router
    if desired == 0:
        return (
            ConditionStatus.FALSE,
            "NoReadyServingPods",
            f"the {policy} router waits for a ready serving pod (0 replicas)",
        )
    if not r.complete(desired):
        return (
            ConditionStatus.FALSE,
            "RolloutInProgress",
            f"{r.ready} ready and {r.updated} updated of {desired} desired router pods "
            f"({r.replicas} exist)",
        )
    return ConditionStatus.TRUE, "RouterReady", f"{desired} {policy} router pods ready"


def _ready(
    seen: Observation, valid: Condition, applied: Condition, router: Condition | None
) -> tuple[ConditionStatus, str, str]:
    if valid.status is not ConditionStatus.TRUE:
        return valid.status, valid.reason, valid.message
    assert seen.spec is not None, "a Valid=True observation carries its spec"
    desired = seen.spec.replicas
    if desired == 0:
        return ConditionStatus.FALSE, "ScaledToZero", "replicas is 0"
    r = seen.rollout
    if not r.observed_latest:
        return (
            ConditionStatus.FALSE,
            "RolloutInProgress",
            f"the Deployment controller has not yet observed generation {r.generation} "
            f"(observed {r.observed})",
        )
    if not r.complete(desired):
        return (
            ConditionStatus.FALSE,
            "RolloutInProgress",
            f"{r.ready} ready and {r.updated} updated of {desired} desired pods "
            f"({r.replicas} exist)",
        )
    for dependency in (applied, router):
        if dependency is not None and dependency.status is not ConditionStatus.TRUE:
            return dependency.status, dependency.reason, dependency.message
    return (
        ConditionStatus.TRUE,
        "Ready",
        f"{desired} pods ready, serving with {seen.spec.policy.value}, routing "
        f"{seen.spec.routing_policy.value}",
    )


def build_status(
    seen: Observation, previous: Mapping[str, Any] | None, now: str
) -> ServingPolicyStatus:
    """The new status; ``previous`` is the current status (for transition times)."""
    old_conditions = list((previous or {}).get("conditions") or [])

    def condition(type_: str, verdict: tuple[ConditionStatus, str, str]) -> Condition:
        return _condition(old_conditions, type_, *verdict, seen.generation, now)

    if seen.spec is None:
        valid = condition(VALID, (ConditionStatus.FALSE, seen.error_reason, seen.error or ""))
    else:
        valid = condition(VALID, (ConditionStatus.TRUE, "SpecValid", "the spec is valid"))
    applied = condition(POLICY_APPLIED, _policy_applied(seen))
    router_verdict = _router_ready(seen)
    router = None if router_verdict is None else condition(ROUTER_READY, router_verdict)
    ready = condition(READY, _ready(seen, valid, applied, router))

    if seen.spec is None:
        phase = Phase.INVALID
    elif seen.spec.replicas == 0:
        phase = Phase.STOPPED
    elif ready.status is ConditionStatus.TRUE:
        phase = Phase.READY
    else:
        phase = Phase.PROGRESSING
    reported = sorted({p.upper() for m in seen.scraped.values() for p in m.policies})
    return ServingPolicyStatus(
        observed_generation=seen.generation,
        phase=phase,
        replicas=seen.rollout.replicas,
        ready_replicas=seen.rollout.ready,
        active_policy=",".join(reported) or None,
        hit_rate=_rounded(seen.hit_rate),
        routing_policy=None if seen.spec is None else seen.spec.routing_policy.value,
        replica_hit_rates=[
            ReplicaHitRate(pod=pod, hit_rate=_rounded(rate))
            for pod, rate in sorted(seen.replica_hit_rates.items())
        ],
        conditions=[valid, applied, *([] if router is None else [router]), ready],
    )


def _rounded(rate: float | None) -> float | None:
    return None if rate is None else round(rate, HIT_RATE_DIGITS)


def status_patch(status: ServingPolicyStatus) -> dict[str, Any]:
    """A JSON merge patch for ``.status``: unset optional fields become null (removed)."""
    patch = status.model_dump(
        mode="json", by_alias=True, exclude={"conditions", "replica_hit_rates"}
    )
    patch["replicaHitRates"] = [
        rate.model_dump(mode="json", by_alias=True, exclude_none=True)
        for rate in status.replica_hit_rates
    ]
    patch["conditions"] = [
        c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in status.conditions
    ]
    return patch
