"""The policy registry serves exactly the shared policy names (docs/architecture.md), which the
operator, the CRD enum and the chart's schema take from arc_serving_common."""

from __future__ import annotations

from arc_evictor.policies import REGISTRY, policy_names
from arc_serving_common.names import POLICY_NAMES


def test_registry_names_are_the_shared_policy_names_in_order() -> None:
    assert tuple(REGISTRY) == POLICY_NAMES
    assert policy_names() == list(POLICY_NAMES)
