"""Helpers for tests/cluster: kubectl and helm bound to a kubeconfig, polling with a deadline,
the installed release and the host operator process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cluster.local import BIN_DIR, LocalCluster

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "out" / "cluster"
CHART = REPO / "charts" / "arc-serving"
HELM = BIN_DIR / "helm"
# Deadlines sized for a slow, shared 2-core machine; the tests poll and return as soon as
# what they wait for is there.
START_TIMEOUT_S = 300.0
WAIT_S = 120.0
REGISTRY = "registry.example.com"
EXAMPLE = REPO / "operator" / "examples" / "servingpolicy-arc.yaml"
# The README's "Quick start on a cluster" install, every flag (the images' registry made up:
# kwok runs no container). The monitoring flags need the Prometheus Operator's CRDs, which
# `make cluster-crds` copies from its Go module into out/cluster/crds.
MONITORING_CRDS = OUT / "crds"
QUICK_START_SETS = (
    f"operator.image.registry={REGISTRY}",
    f"servingPolicy.image.registry={REGISTRY}",
    f"router.image.registry={REGISTRY}",
    f"loadtest.image.registry={REGISTRY}",
    "servingPolicy.model.name=Qwen/Qwen2.5-7B-Instruct",
    "servingPolicy.policy=TRIO",
    "servingPolicy.replicas=2",
    "ingress.enabled=true",
    "ingress.host=llm.example.com",
    "monitoring.podMonitor.enabled=true",
    "prometheusRule.enabled=true",
    "monitoring.podMonitor.labels.release=kube-prometheus-stack",
    "prometheusRule.labels.release=kube-prometheus-stack",
)
# Warnings from the API server or helm that would mean a deprecated or dropped API or field.
DEPRECATION = re.compile(r"deprecat|warning", re.IGNORECASE)

T = TypeVar("T")
# make_policy(name, **spec): a ServingPolicy from the operator's example (conftest.py).
MakePolicy = Callable[..., dict[str, Any]]


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = WAIT_S,
    interval: float = 0.5,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` (and `detail()`,
    what was there instead) at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            seen = detail() if detail is not None else last
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; saw: {seen!r}")
        time.sleep(interval)


@dataclass(frozen=True)
class Kube:
    """kubectl and helm bound to one kubeconfig, with helm's folders under out/cluster."""

    cluster: LocalCluster
    kubeconfig: Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        helm_home = self.cluster.out.resolve() / "helm"
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            HELM_CACHE_HOME=str(helm_home / "cache"),
            HELM_CONFIG_HOME=str(helm_home / "config"),
            HELM_DATA_HOME=str(helm_home / "data"),
            KUBECACHEDIR=str(self.cluster.kube_cache),
        )
        return env

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.cluster.kubectl_path), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, *args: str) -> dict[str, Any] | None:
        """The object as JSON, or None when it does not exist."""
        result = self.run("get", *args, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            pytest.fail(f"kubectl get {' '.join(args)} failed: {result.stderr}")
        return json.loads(result.stdout)

    def apply(self, manifest: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("apply", "-f", "-", *args, input=json.dumps(manifest), check=False)

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(HELM), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    install: subprocess.CompletedProcess[str]

    @property
    def fullname(self) -> str:
        return f"{self.name}-arc-serving"


@dataclass
class HostOperator:
    """The chart's operator command run on this host as the chart's ServiceAccount."""

    process: subprocess.Popen[bytes]
    log: Path
    kubeconfig: Path
    namespace: str
    metrics_port: int

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def condition(sp: dict[str, Any], kind: str) -> dict[str, Any]:
    for c in sp.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return dict(c)
    return {}


def reported(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    """The ServingPolicy once the operator has reported on its current generation."""
    sp = kube.get("servingpolicy", name, "-n", ns)
    if sp and sp.get("status", {}).get("observedGeneration") == sp["metadata"]["generation"]:
        return sp
    return None


def configured_policy(kube: Kube, ns: str, name: str) -> dict[str, Any] | None:
    """The policy file in ServingPolicy ``name``'s ConfigMap, parsed (None while it is absent)."""
    configmap = kube.get("configmap", f"{name}-policy", "-n", ns)
    return None if configmap is None else json.loads(configmap["data"]["policy.json"])


def ready_pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    pods = kube.get(
        "pods",
        "-n",
        ns,
        "-l",
        f"arcserving.io/servingpolicy={name},app.kubernetes.io/component=serving",
    )
    return [
        p
        for p in (pods or {}).get("items", [])
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p.get("status", {}).get("conditions", [])
        )
    ]


def patch(kube: Kube, ns: str, name: str, spec: dict[str, Any]) -> None:
    kube.run(
        "patch",
        "servingpolicy",
        name,
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": spec}),
    )
