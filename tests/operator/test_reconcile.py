"""The reconcile's steps called as plain functions, with a fake API and fake pods."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import kopf
import pytest

from arc_operator.handlers import ROUTER_INDEXES, cleanup, repair_and_report
from arc_operator.metrics import PodMetrics
from arc_operator.models import OperatorConfig
from arc_operator.reconcile import (
    Applied,
    Observed,
    Runtime,
    reconcile,
    repair_deleted_child,
    report,
)
from arc_operator.status import Rollout
from tests.operator.conftest import make_servingpolicy, make_spec, metrics_text

# A deadline sized for a slow, busy machine; the tests wait on events, never on it.
DEADLINE_S = 30.0


def reading(hits: float, queries: float) -> PodMetrics:
    return PodMetrics(policies=frozenset({"lru"}), hits=hits, queries=queries)


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds, at most ``DEADLINE_S``."""
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.01)


def logger_of(body: kopf.Body) -> kopf.LocalObjectLogger:
    return kopf.LocalObjectLogger(body=body, settings=kopf.OperatorSettings())


def ready_pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


class FakeApi:
    """The API calls a pass makes: applies are recorded, the serving pods are one ready pod."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    async def apply(self, manifest: dict[str, Any]) -> None:
        self.applied.append(manifest["kind"])

    async def get(self, path: str) -> None:
        return None

    async def list(self, *_: Any) -> list[dict[str, Any]]:
        return [ready_pod("pod-0")]

    async def delete(self, *_: Any) -> bool:
        return False


class StalledPods:
    """An HTTP client whose /metrics answers only once ``answer`` is set."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()
        self.closed = False

    async def close(self) -> None:
        self.closed = True

    @contextlib.asynccontextmanager
    async def get(self, url: str, timeout: Any) -> AsyncIterator[Any]:
        self.asked.set()
        await self.answer.wait()
        yield self

    def raise_for_status(self) -> None:
        pass

    async def text(self) -> str:
        return metrics_text("lru", 3, 4)


def test_report_keeps_the_readings_of_pods_that_still_exist() -> None:
    observed = Observed(
        rollout=Rollout(),
        router=Rollout(),
        scraped={"b": reading(3, 4)},
        unreachable=0,
        live=frozenset({"a", "b"}),
    )
    previous = {"a": reading(1, 2), "gone": reading(1, 1)}
    result = report(
        Applied(2, None, "spec.replicas: bad"),
        observed,
        previous_status=None,
        previous_readings=previous,
        endpoints=(),
        now="2026-01-01T00:00:00Z",
    )
    assert result.readings == {"a": reading(1, 2), "b": reading(3, 4)}
    assert result.status["observedGeneration"] == 2
    assert result.status["phase"] == "Invalid"
    assert previous == {"a": reading(1, 2), "gone": reading(1, 1)}, "its inputs are left alone"


@pytest.mark.asyncio
async def test_a_stalled_scrape_does_not_hold_up_a_repair() -> None:
    api, pods = FakeApi(), StalledPods()
    runtime = Runtime(config=OperatorConfig(), api=api, http=pods)  # type: ignore[arg-type]
    owner = make_servingpolicy("demo", make_spec())
    body, patch = kopf.Body(owner), kopf.Patch()
    memo = kopf.Memo(runtime=runtime)
    passing = asyncio.create_task(
        reconcile(
            body=body, spec=body.spec, status=body.status, patch=patch, memo=memo,
            logger=logger_of(body), endpoints=(), router_present=frozenset(),
            budgets_present=frozenset(), strict=False,
        )
    )  # fmt: skip
    await asyncio.wait_for(pods.asked.wait(), DEADLINE_S)
    applied_by_the_pass = len(api.applied)
    repair = repair_deleted_child(runtime, [owner], {}, logger_of(body))  # type: ignore[arg-type]
    await asyncio.wait_for(repair, DEADLINE_S)
    assert len(api.applied) == 2 * applied_by_the_pass, "the repair applied during the scrape"
    assert not passing.done()
    pods.answer.set()
    await asyncio.wait_for(passing, DEADLINE_S)
    assert patch.status["activePolicy"] == "LRU"
    assert set(memo["readings"]) == {"pod-0"}


@pytest.mark.asyncio
async def test_a_pass_reports_the_generation_whose_spec_it_applied() -> None:
    """kopf replaces a handler's live body when a newer event arrives mid-pass (here during
    the scrape): the status still describes what this pass applied, generation 1."""
    api, pods = FakeApi(), StalledPods()
    runtime = Runtime(config=OperatorConfig(), api=api, http=pods)  # type: ignore[arg-type]
    owner = make_servingpolicy("demo", make_spec(policy="LRU"))
    body, patch = kopf.Body(owner), kopf.Patch()
    passing = asyncio.create_task(
        reconcile(
            body=body, spec=body.spec, status=body.status, patch=patch,
            memo=kopf.Memo(runtime=runtime), logger=logger_of(body), endpoints=(),
            router_present=frozenset(), budgets_present=frozenset(), strict=False,
        )
    )  # fmt: skip
    await asyncio.wait_for(pods.asked.wait(), DEADLINE_S)
    body._replace_with(make_servingpolicy("demo", make_spec(policy="ARC"), generation=2))
    assert body.meta["generation"] == 2 and body.spec["policy"] == "ARC"
    pods.answer.set()
    await asyncio.wait_for(passing, DEADLINE_S)
    assert patch.status["observedGeneration"] == 1
    assert {c["observedGeneration"] for c in patch.status["conditions"]} == {1}


@pytest.mark.asyncio
async def test_passes_report_in_the_order_they_applied() -> None:
    api, pods = FakeApi(), StalledPods()
    runtime = Runtime(config=OperatorConfig(), api=api, http=pods)  # type: ignore[arg-type]
    body = kopf.Body(make_servingpolicy("demo", make_spec()))
    memo = kopf.Memo(runtime=runtime)
    finished: list[str] = []

    async def run(label: str) -> None:
        await reconcile(
            body=body, spec=body.spec, status=body.status, patch=kopf.Patch(), memo=memo,
            logger=logger_of(body), endpoints=(), router_present=frozenset(),
            budgets_present=frozenset(), strict=False,
        )  # fmt: skip
        finished.append(label)

    first = asyncio.create_task(run("first"))
    await asyncio.wait_for(pods.asked.wait(), DEADLINE_S)
    applied_by_a_pass = len(api.applied)
    second = asyncio.create_task(run("second"))
    # The second pass applies while the first scrapes, then waits for its turn to observe.
    await until(lambda: len(api.applied) == 2 * applied_by_a_pass)
    assert finished == []
    pods.answer.set()
    await asyncio.wait_for(asyncio.gather(first, second), DEADLINE_S)
    assert finished == ["first", "second"]


def timer_kwargs(body: kopf.Body, memo: kopf.Memo) -> dict[str, Any]:
    """The keyword arguments kopf hands the status timer (the indexes empty)."""
    return {
        "body": body, "spec": body.spec, "status": body.status, "patch": kopf.Patch(),
        "memo": memo, "logger": logger_of(body), "name": body.meta.name,
        "namespace": body.meta.namespace, "serving_endpoints": {}, "budgets": {},
        **{index: {} for index in ROUTER_INDEXES},
    }  # fmt: skip


@pytest.mark.asyncio
async def test_cleanup_closes_the_clients_after_the_pass_in_flight() -> None:
    api, pods = FakeApi(), StalledPods()
    runtime = Runtime(config=OperatorConfig(), api=api, http=pods)  # type: ignore[arg-type]
    body = kopf.Body(make_servingpolicy("demo", make_spec()))
    memo = kopf.Memo(runtime=runtime)
    kwargs = timer_kwargs(body, memo)
    passing = asyncio.create_task(repair_and_report(**kwargs))
    await asyncio.wait_for(pods.asked.wait(), DEADLINE_S)
    closing = asyncio.create_task(cleanup(memo=memo, logger=logger_of(body)))
    await until(lambda: runtime.passes.closing)
    assert not (api.closed or pods.closed), "the clients stay open while the pass runs"
    pods.answer.set()
    await asyncio.wait_for(asyncio.gather(passing, closing), DEADLINE_S)
    assert kwargs["patch"].status["activePolicy"] == "LRU", "the pass finished its report"
    assert api.closed and pods.closed

    # A timer that kopf fires after cleanup began touches neither client nor the status.
    applied = len(api.applied)
    late = timer_kwargs(body, memo)
    await repair_and_report(**late)
    assert len(api.applied) == applied
    assert not late["patch"]


@pytest.mark.asyncio
async def test_cleanup_closes_the_clients_after_its_grace_if_a_pass_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("arc_operator.handlers.SHUTDOWN_GRACE_S", 0.2)
    api, pods = FakeApi(), StalledPods()
    runtime = Runtime(config=OperatorConfig(), api=api, http=pods)  # type: ignore[arg-type]
    body = kopf.Body(make_servingpolicy("demo", make_spec()))
    memo = kopf.Memo(runtime=runtime)
    passing = asyncio.create_task(repair_and_report(**timer_kwargs(body, memo)))
    await asyncio.wait_for(pods.asked.wait(), DEADLINE_S)
    await asyncio.wait_for(cleanup(memo=memo, logger=logger_of(body)), DEADLINE_S)
    assert api.closed and pods.closed
    passing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await passing
