"""Helpers of the live dashboard and alert tests: the chart's rules on a shorter clock, an alert
recorder, a recorder of each rule evaluation, the scrape job of the chart's router PodMonitor,
and the load that causes each alert on the real vLLM server."""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import requests

from arc_harness.prometheus import EngineTarget, PrometheusError, PrometheusServer, pod_monitor_job
from arc_harness.vllm_server import VllmServer
from arc_operator.manifests import ROUTER_CONTAINER, ROUTER_METRICS_PORT_NAME

SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
# A duration in a range selector ("[15m]") or after "offset".
RULE_DURATION = re.compile(r"(\[|offset\s+)(\d+)(ms|s|m|h|d)\b")
VOCABULARY = range(4, 1024)  # the tiny Llama's token ids, special tokens left out


def shorter(duration: str, factor: int) -> str:
    """``duration`` (a Prometheus duration such as ``15m``) divided by ``factor``."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)", duration)
    assert match, f"not a single-unit duration: {duration!r}"
    milliseconds = round(int(match.group(1)) * SECONDS[match.group(2)] * 1000 / factor)
    return f"{milliseconds // 1000}s" if milliseconds % 1000 == 0 else f"{milliseconds}ms"


def shortened_rules(groups: Sequence[dict[str, Any]], factor: int) -> dict[str, Any]:
    """The rule file with every duration (``for:``, range windows, offsets) divided by
    ``factor``; thresholds, labels and the rest of each expression stay as they are."""
    rewritten = []
    for group in groups:
        rules = []
        for rule in group["rules"]:
            rule = dict(rule)
            rule["expr"] = RULE_DURATION.sub(
                lambda m: m.group(1) + shorter(m.group(2) + m.group(3), factor), rule["expr"]
            )
            if "for" in rule:
                rule["for"] = shorter(rule["for"], factor)
            rules.append(rule)
        rewritten.append(dict(group) | {"rules": rules})
    return {"groups": rewritten}


def router_monitor_job(
    namespace: str, monitor: str, targets: Sequence[EngineTarget], interval_s: float
) -> dict[str, Any]:
    """The scrape job the Prometheus Operator generates for the chart's router PodMonitor: the
    engine job's labels and relabelling, with the router pod's container and metrics port names
    (the operator's, arc_operator.manifests)."""
    job = pod_monitor_job(namespace, monitor, targets, interval_s)
    for static in job["static_configs"]:
        static["labels"]["__meta_kubernetes_pod_container_name"] = ROUTER_CONTAINER
    for rule in job["relabel_configs"]:
        if rule.get("target_label") == "endpoint":
            rule["replacement"] = ROUTER_METRICS_PORT_NAME
    return job


@dataclass(frozen=True, slots=True)
class AlertSeen:
    at: float
    name: str
    state: str  # pending or firing
    labels: dict[str, str]
    value: str = ""  # the expression's value, where the API gives it


@dataclass(slots=True)
class AlertRecorder:
    """Polls /api/v1/alerts in a thread and keeps every (time, alert, state) it sees."""

    prometheus: PrometheusServer
    poll_s: float = 0.5
    seen: list[AlertSeen] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.time()
            try:
                alerts = self.prometheus.alerts()
            except PrometheusError as error:
                self.errors.append(str(error))
                continue
            for alert in alerts:
                labels = dict(alert["labels"])
                self.seen.append(AlertSeen(now, labels.pop("alertname"), alert["state"], labels))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def states(self, name: str, start: float, end: float) -> set[str]:
        return {a.state for a in self.seen if a.name == name and start <= a.at <= end}

    def active_between(self, start: float, end: float) -> list[AlertSeen]:
        return [a for a in self.seen if start <= a.at <= end]

    def wait_until_inactive(self, names: Iterable[str], timeout_s: float) -> None:
        """Wait until Prometheus reports none of the alerts ``names`` pending or firing."""
        quiet = set(names)
        self.prometheus.wait_until(
            lambda: quiet.isdisjoint(a["labels"]["alertname"] for a in self.prometheus.alerts()),
            timeout_s,
            f"alerts {sorted(quiet)} inactive",
        )

    def wait_for(self, wanted: Mapping[str, str], since: float, timeout_s: float) -> None:
        """Wait until each alert in ``wanted`` was seen in its state (or firing) after ``since``;
        the error says which states each one reached instead."""
        try:
            self.prometheus.wait_until(
                lambda: all(
                    {state, "firing"} & self.states(name, since, time.time())
                    for name, state in wanted.items()
                ),
                timeout_s,
                f"alerts {dict(wanted)}",
            )
        except PrometheusError as error:
            reached = {name: sorted(self.states(name, since, time.time())) for name in wanted}
            raise PrometheusError(f"{error}; states seen: {reached}") from None


def complete(server: VllmServer, prompt: list[int], max_tokens: int) -> None:
    """One non-streamed completion of token ids; raises on an error answer."""
    body = {
        "model": server.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
    }
    answer = requests.post(f"{server.base_url}/v1/completions", json=body, timeout=180,
                           headers=server.auth_headers)  # fmt: skip
    answer.raise_for_status()


@contextmanager
def steady_load(
    server: VllmServer, prompts: Iterator[list[int]], max_tokens: int, in_flight: int
) -> Iterator[list[str]]:
    """``in_flight`` requests outstanding at all times until the block ends (errors listed)."""
    stop = threading.Event()
    lock = threading.Lock()
    errors: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            with lock:
                prompt = next(prompts)
            try:
                complete(server, prompt, max_tokens)
            except requests.RequestException as error:
                errors.append(str(error))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(in_flight)]
    for thread in threads:
        thread.start()
    try:
        yield errors
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)


def unique_prompts(tokens: int, seed: int) -> Iterator[list[int]]:
    """Prompts that share no block with each other: nothing can hit the prefix cache."""
    rng = random.Random(seed)
    while True:
        yield [rng.choice(VOCABULARY) for _ in range(tokens)]


def shared_prefix_prompts(prefix_tokens: int, suffix_tokens: int, seed: int) -> Iterator[list[int]]:
    """Prompts with one common prefix and a distinct short suffix each."""
    rng = random.Random(seed)
    prefix = [rng.choice(VOCABULARY) for _ in range(prefix_tokens)]
    while True:
        yield prefix + [rng.choice(VOCABULARY) for _ in range(suffix_tokens)]


def parse_rfc3339(stamp: str) -> float:
    """A timestamp of Prometheus's API (RFC 3339, nanoseconds) as seconds since the epoch."""
    stamp = re.sub(r"(\.\d{6})\d+", r"\1", stamp).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation of one alert rule: when, and the alerts it left pending or firing."""

    at: float
    alerts: tuple[AlertSeen, ...]  # ``at`` of each is the evaluation's


@dataclass(slots=True)
class EvaluationRecorder:
    """Polls /api/v1/rules in a thread and keeps each evaluation of the alert rules of group
    ``group`` once: the rule's last evaluation time and the alerts it left active.

    Unlike ``AlertRecorder``, which sees alerts whenever it polls, this ties each state to
    the evaluation that produced it, so a test can compare it with what it measured over the
    rule's own window ending at that evaluation.
    """

    prometheus: PrometheusServer
    group: str
    poll_s: float = 0.2
    evaluations: dict[str, list[Evaluation]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                groups = self.prometheus.api("rules", {"type": "alert"})["groups"]
            except PrometheusError as error:
                self.errors.append(str(error))
                continue
            for group in groups:
                if group["name"] != self.group:
                    continue
                for rule in group["rules"]:
                    self._record(rule)

    def _record(self, rule: Mapping[str, Any]) -> None:
        stamp = rule.get("lastEvaluation", "")
        if not stamp or stamp.startswith("0001-"):  # not evaluated yet
            return
        at = parse_rfc3339(stamp)
        seen = self.evaluations.setdefault(rule["name"], [])
        if seen and seen[-1].at >= at:
            return
        alerts = []
        for alert in rule.get("alerts", []):
            labels = dict(alert["labels"])
            name, state, value = labels.pop("alertname"), alert["state"], alert.get("value", "")
            alerts.append(AlertSeen(at, name, state, labels, value))
        seen.append(Evaluation(at, tuple(alerts)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def of(self, name: str, start: float, end: float) -> list[Evaluation]:
        """The evaluations of rule ``name`` recorded at ``start`` .. ``end``."""
        return [e for e in self.evaluations.get(name, []) if start <= e.at <= end]
