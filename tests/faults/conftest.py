"""Fixtures for the fault-injection tests.

The operator faults reuse the operator tests' kmock cluster, /metrics stand-in and in-process
kopf operator (re-exported here so pytest finds them); the serving faults share one real
vLLM server per module (defined in their modules).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from arc_operator.models import OperatorConfig
from tests.operator import conftest as operator_fixtures
from tests.operator.conftest import PodMetricsServer, RunningOperator

# The operator tests' fixtures, under their names so pytest finds them for these tests too.
cluster = operator_fixtures.cluster
operator = operator_fixtures.operator
pod_metrics = operator_fixtures.pod_metrics

# A timer interval no test waits for: a repair seen within a test came from an event.
NO_TIMER_S = 3600.0


@pytest_asyncio.fixture
async def slow_timer_operator(
    cluster, pod_metrics: PodMetricsServer
) -> AsyncIterator[RunningOperator]:
    """The real operator whose drift-repair timer fires once at start and then not again."""
    running = RunningOperator(
        OperatorConfig(metrics_port=pod_metrics.port, status_interval=NO_TIMER_S)
    )
    await running.start()
    yield running
    await running.stop()
