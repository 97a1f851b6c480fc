"""Helpers shared by the Helm chart tests: the real helm 4 and promtool from .tools/bin.

`make tools` fetches both (the Makefile's `test` target depends on it). The chart tests run
`helm template` and read its output; helm-unittest is not installable offline.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from arc_serving_common.names import METRIC_NAMES

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "arc-serving"
TOOLS = REPO / ".tools" / "bin"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
CRD_FILE = CHART / "crds" / "servingpolicies.arcserving.io.yaml"
RBAC_FILE = CHART / "files" / "operator-rbac-rules.yaml"
# The dashboards' generator, a script next to the JSON it writes (excluded from the package).
DASHBOARDS_GENERATOR = CHART / "dashboards" / "generate.py"
ALERTS_FILE = CHART / "files" / "alerts.yaml"
# The Gateway API's standard CRDs, which `make cluster-crds` copies from the project's Go module
# into the Makefile's CLUSTER_OUT (out/cluster).
HTTPROUTE_CRD = REPO / "out/cluster/crds/gateway-api/gateway.networking.k8s.io_httproutes.yaml"
RELEASE = "rel"
NAMESPACE = "llm"
# Every helm call is bounded; rendering this chart takes well under a second.
HELM_TIMEOUT_S = 60

# The plugin's metric names (docs/architecture.md, "Plugin contract"), as the code shares them.
PLUGIN_METRICS = frozenset(METRIC_NAMES)
# Series every Prometheus target has.
SCRAPE_METRICS = frozenset({"up"})
# vllm-router 0.1.17's series on its --prometheus-port that the dashboards and alerts read, as
# read from a running router's /metrics (counters keep their _total, histograms end in
# _bucket/_sum/_count); router_registers() finds each family in the installed router.
ROUTER_HISTOGRAMS = frozenset({"vllm_router_generate_duration_seconds"})
ROUTER_METRICS = frozenset(
    {
        "vllm_router_prefix_routing_decisions_total",
        "vllm_router_kv_placement_lookups_total",
        "vllm_router_worker_health",
        "vllm_router_cb_state",
    }
    | {f"{name}{suffix}" for name in ROUTER_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)


def tool(name: str) -> Path:
    """Path of a binary `make tools` installs; fails the test with the fix when absent."""
    path = TOOLS / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make tools` (it fetches helm and promtool)")
    return path


def run(args: list[str | Path], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a command with a time bound, capturing text output."""
    return subprocess.run(
        [str(arg) for arg in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=HELM_TIMEOUT_S,
        check=False,
    )


@cache
def httproute_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the HTTPRoute CRD's v1 (the version the chart renders)."""
    if not HTTPROUTE_CRD.is_file():
        pytest.fail(f"{HTTPROUTE_CRD} is missing: run `make cluster-crds` (the Gateway API CRDs)")
    crd = yaml.safe_load(HTTPROUTE_CRD.read_text(encoding="utf-8"))
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def helm_template(
    *values_files: Path,
    sets: Mapping[str, str] | None = None,
    release: str = RELEASE,
    extra: Iterable[str] = (),
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart with values files and --set pairs (not checked)."""
    args: list[str | Path] = [tool("helm"), "template", release, CHART, "--namespace", NAMESPACE]
    for path in values_files:
        args += ["--values", path]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return run([*args, *extra])


def render(
    *values_files: Path, sets: Mapping[str, str] | None = None, release: str = RELEASE
) -> list[dict[str, Any]]:
    """The rendered objects (hooks and tests included); fails the test on a helm error."""
    result = helm_template(*values_files, sets=sets, release=release)
    if result.returncode != 0:
        pytest.fail(f"helm template failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rendered objects of one kind, in output order."""
    return [obj for obj in objects if obj["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The single rendered object of one kind."""
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def ci_values(name: str) -> Path:
    """A values variant under charts/arc-serving/ci/."""
    path = CHART / "ci" / name
    assert path.is_file(), f"missing values variant {path}"
    return path


@cache
def vllm_metric_names() -> frozenset[str]:
    """Series names vLLM's Prometheus logger exposes, read from the installed vllm source.

    Every metric in vllm/v1/metrics/*.py is created as ``self._counter_cls(name=...)``,
    ``_gauge_cls`` or ``_histogram_cls``; prometheus_client exposes a counter as
    ``NAME_total`` and a histogram as ``NAME_bucket``/``_sum``/``_count``.
    """
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    metrics_dir = Path(spec.origin).parent / "v1" / "metrics"
    suffixes = {
        "_counter_cls": ("_total",),
        "_gauge_cls": ("",),
        "_histogram_cls": ("_bucket", "_sum", "_count"),
    }
    names: set[str] = set()
    for source in sorted(metrics_dir.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in suffixes:
                continue
            for keyword in node.keywords:
                if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                    base = str(keyword.value.value).removesuffix("_total")
                    names.update(base + suffix for suffix in suffixes[node.func.attr])
    return frozenset(names)


@cache
def _router_extension() -> bytes:
    spec = importlib.util.find_spec("vllm_router_rs")  # locates the extension, no import
    assert spec is not None and spec.origin is not None, "vllm-router is not installed"
    return Path(spec.origin).read_bytes()


def router_registers(family: str) -> bool:
    """Whether the installed router (PyPI vllm-router) names metric family ``family``.

    The router names its metrics in string literals of its compiled Rust extension, so a family
    missing there is one this router version never exports.
    """
    return family.encode() in _router_extension()


@cache
def dashboards_generator() -> ModuleType:
    """charts/arc-serving/dashboards/generate.py, imported from its path (it is no package's)."""
    spec = importlib.util.spec_from_file_location("arc_serving_dashboards", DASHBOARDS_GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses and generics look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def known_metric_names() -> frozenset[str]:
    """Every series name a dashboard or alert may query."""
    return vllm_metric_names() | PLUGIN_METRICS | SCRAPE_METRICS | ROUTER_METRICS
