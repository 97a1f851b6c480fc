"""Start a real Prometheus server on 127.0.0.1 that scrapes local vLLM engines as the chart's
PodMonitor would, for tests and the demo's dashboard snapshot.

``PrometheusServer`` is a context manager like ``arc_harness.vllm_server.VllmServer``: entering
writes the configuration and rule files to a fresh directory, starts the ``prometheus`` binary
(``make tools`` unpacks it from Debian's package into ``.tools/bin``) with its own time-series
store there, and waits for ``/-/ready`` within a bounded time; leaving stops it and removes the
directory.

``pod_monitor_job`` builds a scrape job whose series carry the labels the Prometheus Operator
gives a PodMonitor's targets (``namespace``, ``pod``, ``container``, ``endpoint``, ``job``) and,
through the chart's own relabelling, ``servingpolicy``: each local target carries the
``__meta_kubernetes_*`` labels Kubernetes service discovery would give the pod, and the same
relabelling rules turn them into target labels.

``pod_monitor_discovery_job`` builds the job the Prometheus Operator writes for a rendered
PodMonitor, finding pods through ``PodDiscovery``: HTTP service discovery fed by the API server,
labelled as Kubernetes service discovery labels pods (Debian's Prometheus is built without the
latter), for the end-to-end tests on a real cluster.

``load_dashboard``, ``panel_queries``, ``Intervals`` and ``expand`` turn the chart's dashboards
(the committed JSON) into the queries Grafana would send, for tests and the snapshot.

Invariant: the server only listens on 127.0.0.1 and only scrapes the targets it is given or
the pods its discovery lists.
"""

from __future__ import annotations

import http.server
import json
import math
import re
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from arc_harness.vllm_server import free_port

REPO = Path(__file__).resolve().parents[3]
PROMETHEUS_BINARY = REPO / ".tools" / "bin" / "prometheus"
# The chart's engine relabelling (templates/_helpers.tpl, arc-serving.engineRelabelings), in
# Prometheus's own spelling; tests/prometheus checks it against the rendered PodMonitor.
CHART_RELABELINGS: tuple[dict[str, Any], ...] = (
    {
        "source_labels": ["__meta_kubernetes_pod_label_arcserving_io_servingpolicy"],
        "target_label": "servingpolicy",
    },
)
ENGINE_CONTAINER = "vllm"
ENGINE_PORT_NAME = "http"


class PrometheusError(RuntimeError):
    """Prometheus did not come up, or its API answered with an error."""


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One engine as Kubernetes would describe its pod: address, namespace, name, policy."""

    address: str  # host:port on 127.0.0.1
    namespace: str
    pod: str
    servingpolicy: str


def pod_monitor_job(
    namespace: str,
    monitor: str,
    targets: Sequence[EngineTarget],
    interval_s: float,
    relabelings: Sequence[Mapping[str, Any]] = CHART_RELABELINGS,
) -> dict[str, Any]:
    """The scrape job the Prometheus Operator generates for PodMonitor ``namespace/monitor``.

    The operator's own rules come first (namespace, container, pod, job, endpoint), then the
    monitor's ``relabelings``, as in the configuration it writes.
    """
    interval = f"{int(interval_s * 1000)}ms"
    return {
        "job_name": f"podMonitor/{namespace}/{monitor}/0",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "metrics_path": "/metrics",
        "static_configs": [
            {
                "targets": [target.address],
                "labels": {
                    "__meta_kubernetes_namespace": target.namespace,
                    "__meta_kubernetes_pod_name": target.pod,
                    "__meta_kubernetes_pod_container_name": ENGINE_CONTAINER,
                    "__meta_kubernetes_pod_label_arcserving_io_servingpolicy": (
                        target.servingpolicy
                    ),
                },
            }
            for target in targets
        ],
        "relabel_configs": [
            *_target_labels(namespace, monitor, ENGINE_PORT_NAME),
            *[dict(rule) for rule in relabelings],
        ],
    }


def _target_labels(namespace: str, monitor: str, port: str) -> list[dict[str, Any]]:
    """The Prometheus Operator's own target labels for PodMonitor ``namespace/monitor``."""
    return [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{namespace}/{monitor}"},
        {"target_label": "endpoint", "replacement": port},
    ]


def _relabeling(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A PodMonitor relabeling (the operator's camelCase) in Prometheus's own spelling."""
    spelling = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {spelling.get(key, key): value for key, value in rule.items()}


def _label_meta(label: str) -> str:
    """A pod label's name in Kubernetes service discovery's meta labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_monitor_discovery_job(
    pod_monitor: Mapping[str, Any], discovery_url: str, interval_s: float
) -> dict[str, Any]:
    """The scrape job the Prometheus Operator writes for a rendered ``pod_monitor`` (its first
    endpoint), with the pods found through ``discovery_url``, a ``PodDiscovery`` endpoint that
    gives each pod the meta labels Kubernetes service discovery gives it.

    As the operator does: the monitor's namespace (or every namespace), pods whose labels match
    the selector's ``matchLabels``, the container port named as the endpoint's, then its own
    target labels and the monitor's relabelings. ``interval_s`` replaces the monitor's interval
    (tests scrape faster than a user's 15 s)."""
    spec = pod_monitor["spec"]
    endpoint = spec["podMetricsEndpoints"][0]
    namespace, name = pod_monitor["metadata"]["namespace"], pod_monitor["metadata"]["name"]
    keep: list[tuple[list[str], str]] = []
    if not spec.get("namespaceSelector", {}).get("any"):
        keep.append((["__meta_kubernetes_namespace"], re.escape(namespace)))
    for label, value in spec["selector"].get("matchLabels", {}).items():
        meta = _label_meta(label)
        keep.append(
            (
                [
                    f"__meta_kubernetes_pod_label_{meta}",
                    f"__meta_kubernetes_pod_labelpresent_{meta}",
                ],
                f"({re.escape(value)});true",
            )
        )
    keep.append((["__meta_kubernetes_pod_container_port_name"], endpoint["port"]))
    interval = f"{int(interval_s * 1000)}ms"
    return {
        "job_name": f"podMonitor/{namespace}/{name}/0",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "metrics_path": endpoint.get("path", "/metrics"),
        "http_sd_configs": [{"url": discovery_url, "refresh_interval": interval}],
        "relabel_configs": [
            {
                "action": "drop",
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
            },
            *(
                {"action": "keep", "source_labels": labels, "regex": regex}
                for labels, regex in keep
            ),
            *_target_labels(namespace, name, endpoint["port"]),
            *[_relabeling(rule) for rule in endpoint.get("relabelings", [])],
        ],
    }


def pod_targets(pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus HTTP service-discovery target groups for ``pods`` (Kubernetes Pod objects):
    one per declared container port of a pod with an IP, labelled as Kubernetes service
    discovery's ``pod`` role labels it (the labels the Prometheus Operator's rules read)."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            continue
        meta = pod["metadata"]
        common = {
            "__meta_kubernetes_namespace": meta["namespace"],
            "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_ip": ip,
            "__meta_kubernetes_pod_node_name": pod["spec"].get("nodeName", ""),
            "__meta_kubernetes_pod_phase": pod["status"].get("phase", ""),
        }
        for label, value in (meta.get("labels") or {}).items():
            common[f"__meta_kubernetes_pod_label_{_label_meta(label)}"] = value
            common[f"__meta_kubernetes_pod_labelpresent_{_label_meta(label)}"] = "true"
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                labels = {
                    **common,
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                }
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels})
    return groups


class PodDiscovery:
    """Prometheus HTTP service discovery on 127.0.0.1 serving ``pod_targets(list_pods())`` at
    each refresh: Kubernetes service discovery's pod role for a Prometheus built without it
    (Debian's package). Use as ``with PodDiscovery(list_pods) as discovery:``, ``discovery.url``.
    """

    def __init__(self, list_pods: Callable[[], Sequence[Mapping[str, Any]]]) -> None:
        self.list_pods = list_pods
        self._server: http.server.ThreadingHTTPServer | None = None
        self.url = ""

    def __enter__(self) -> PodDiscovery:
        list_pods = self.list_pods

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(pod_targets(list_pods())).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/targets"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class PrometheusServer:
    """One Prometheus process; use as ``with PrometheusServer(jobs, ...) as prometheus:``.

    ``scrape_jobs`` are scrape_configs entries, ``rule_files`` maps file names to rule-file
    contents (``groups: ...``). Rules are evaluated every ``evaluation_interval_s``.
    """

    def __init__(
        self,
        scrape_jobs: Sequence[Mapping[str, Any]],
        *,
        rule_files: Mapping[str, Mapping[str, Any]] | None = None,
        evaluation_interval_s: float = 1.0,
        binary: Path = PROMETHEUS_BINARY,
        log_path: Path | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if not binary.is_file():
            raise PrometheusError(f"{binary} is missing: run `make tools`")
        self.scrape_jobs = [dict(job) for job in scrape_jobs]
        self.rule_files = dict(rule_files or {})
        self.evaluation_interval_s = evaluation_interval_s
        self.binary = binary
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.base_url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def configuration(self, folder: Path) -> dict[str, Any]:
        """prometheus.yml, with the rule files written to ``folder``."""
        for name, groups in self.rule_files.items():
            (folder / name).write_text(yaml.safe_dump(dict(groups), sort_keys=False))
        interval = f"{int(self.evaluation_interval_s * 1000)}ms"
        return {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(folder / name) for name in self.rule_files],
            "scrape_configs": self.scrape_jobs,
        }

    def start(self) -> PrometheusServer:
        if self._proc is not None:
            raise RuntimeError("PrometheusServer already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="arc-prometheus-")
        folder = Path(self._tmp.name)
        config = folder / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.configuration(folder), sort_keys=False))
        self.log_path = self.log_path or folder / "prometheus.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [
            str(self.binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited at start-up:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready after {self.startup_timeout_s:.0f}s")

    def ready(self) -> bool:
        """True when ``/-/ready`` answers 200 now."""
        try:
            # base_url is http://127.0.0.1:PORT, set in start(), never user input.
            with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2) as answer:  # nosec B310
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------ HTTP API
    def api(self, path: str, params: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()) -> Any:
        """``GET /api/v1/<path>``'s ``data``; raises PrometheusError on an error answer."""
        query = urllib.parse.urlencode(
            list(params.items()) if isinstance(params, Mapping) else list(params)
        )
        url = f"{self.base_url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            # base_url is http://127.0.0.1:PORT, set in start(), never user input.
            with urllib.request.urlopen(url, timeout=30) as answer:  # nosec B310
                body = json.loads(answer.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
        except (urllib.error.URLError, OSError) as error:
            raise PrometheusError(f"{url}: {error}") from error
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params)}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
        return self.api("query", params)["result"]

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        """A range query's matrix: ``[{"metric": labels, "values": [[t, "v"], ...]}, ...]``."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step_s}
        return self.api("query_range", params)["result"]

    def series(self, match: str, start: float, end: float) -> list[dict[str, str]]:
        """Label sets of the series matching ``match`` between ``start`` and ``end``."""
        return self.api(
            "series", [("match[]", match), ("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
        )

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now (``/api/v1/alerts``)."""
        return self.api("alerts")["alerts"]

    def wait_until(
        self, condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5
    ) -> None:
        """Poll ``condition`` until it holds; raise PrometheusError naming ``what`` on timeout."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise PrometheusError(f"{what}: not seen within {timeout_s:.0f}s")
            time.sleep(poll_s)


# ------------------------------------------------------- what Grafana sends to Prometheus
# The chart's dashboards as Grafana reads them: the JSON files the chart ships (generated by
# charts/arc-serving/dashboards/generate.py; tests/chart checks they are its output).
CHART_DASHBOARDS = REPO / "charts" / "arc-serving" / "dashboards"


def dashboard_names() -> list[str]:
    """The file names of the chart's dashboards, sorted."""
    return sorted(path.name for path in CHART_DASHBOARDS.glob("*.json"))


def load_dashboard(name: str) -> dict[str, Any]:
    """Dashboard ``name`` (a file under ``CHART_DASHBOARDS``) as Grafana reads it."""
    return json.loads((CHART_DASHBOARDS / name).read_text(encoding="utf-8"))


# Grafana's default maxDataPoints is the panel's width in pixels: a half-width panel on a
# 1920-pixel screen is about this wide.
MAX_DATA_POINTS = 900
# Characters Grafana's Prometheus data source escapes in a regex-matched variable value
# (prometheusSpecialRegexEscape); the backslash is doubled once more for the PromQL string.
REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One query of one panel, with what the panel shows it as."""

    panel: str
    ref_id: str
    expr: str
    legend: str
    unit: str


def panel_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Every panel target of ``dashboard`` (rows have none), in panel order."""
    return [
        PanelQuery(
            panel["title"],
            target["refId"],
            target["expr"],
            target.get("legendFormat", ""),
            panel["fieldConfig"]["defaults"].get("unit", ""),
        )
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def duration(seconds: float) -> str:
    """A PromQL duration as Grafana writes an interval (whole seconds, else milliseconds)."""
    return f"{seconds:g}s" if float(seconds).is_integer() else f"{round(seconds * 1000)}ms"


@dataclass(frozen=True, slots=True)
class Intervals:
    """Grafana's interval variables for one time range (docs: "Global variables").

    ``$__interval`` is the range over the panel's maxDataPoints, never under the data
    source's scrape interval (its min interval) or a query's own minimum step;
    ``$__rate_interval`` is max($__interval + scrape interval, 4 * scrape interval).
    The range query's step is ``$__interval``.
    """

    interval_s: float
    rate_interval_s: float

    @classmethod
    def for_range(
        cls, range_s: float, scrape_interval_s: float, min_step_s: float = 0.0
    ) -> Intervals:
        interval = max(range_s / MAX_DATA_POINTS, scrape_interval_s, min_step_s)
        # Grafana steps in whole milliseconds, whole seconds from one second on.
        interval = math.ceil(interval) if interval >= 1 else math.ceil(interval * 1000) / 1000
        interval = float(interval)
        return cls(interval, float(max(interval + scrape_interval_s, 4 * scrape_interval_s)))

    def align(self, start: float, end: float) -> tuple[float, float]:
        """The range Grafana asks for: both ends floored to a multiple of the step."""
        return (
            math.floor(start / self.interval_s) * self.interval_s,
            math.floor(end / self.interval_s) * self.interval_s,
        )


def variable_value(values: Sequence[str] | None) -> str:
    """A multi-value, include-All variable as Grafana puts it into a ``=~`` matcher.

    ``None`` is "All" (the variables' allValue ``.*``); one value is regex-escaped, several
    become ``(a|b)``.
    """
    if values is None:
        return ".*"
    escaped = [
        REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(), value.replace("\\", "\\" * 4))
        for value in values
    ]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def expand(expr: str, intervals: Intervals, selection: Mapping[str, Sequence[str] | None]) -> str:
    """``expr`` with Grafana's interval variables and the dashboard variables filled in."""
    expr = re.sub(r"\$\{?__rate_interval\}?", duration(intervals.rate_interval_s), expr)
    expr = re.sub(r"\$\{?__interval\}?", duration(intervals.interval_s), expr)
    for name in sorted(selection, key=len, reverse=True):
        expr = re.sub(
            rf"\$\{{{name}\}}|\${name}\b",
            lambda _, name=name: variable_value(selection[name]),
            expr,
        )
    if "$" in expr:
        raise ValueError(f"a variable is left unexpanded in {expr!r}")
    return expr
