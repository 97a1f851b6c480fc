"""Fixtures for the tests against a real Kubernetes 1.35 control plane (cluster/): the real
kube-apiserver, etcd, controller manager and scheduler with kwok's fake nodes, driven with the
real helm and kubectl.

The session starts the cluster with `cluster.LocalCluster` (as `make cluster` does) and stops
it at the end, or reuses one that already answers (`make cluster` first: the tests then leave it
running). Each session installs the chart into a namespace of its own, so a reused cluster
needs no cleaning between runs.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from cluster.local import BINARY_ENV, LocalCluster
from tests.cluster.helpers import (
    CHART,
    EXAMPLE,
    OUT,
    QUICK_START_SETS,
    START_TIMEOUT_S,
    HostOperator,
    Kube,
    MakePolicy,
    Release,
    apply_monitoring_crds,
    launch_operator,
    operator_paused,
)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(out=OUT)
    missing = [
        name
        for name in [*BINARY_ENV.values(), "kwokctl", "helm"]
        if not (cluster.bin_dir / name).is_file()
    ]
    if missing:
        pytest.fail(f"no {', '.join(missing)} in {cluster.bin_dir}: run `make cluster-binaries`")
    started = cluster.up(timeout=START_TIMEOUT_S)
    try:
        yield cluster
    finally:
        if started:
            cluster.down()


@pytest.fixture(scope="session")
def kube(local_cluster: LocalCluster) -> Kube:
    return Kube(local_cluster, local_cluster.kubeconfig)


def _remove_finalizers(kube: Kube, namespace: str) -> None:
    listed = kube.get("servingpolicies", "-n", namespace)
    for item in (listed or {}).get("items", []):
        kube.run(
            "patch",
            "servingpolicy",
            item["metadata"]["name"],
            "-n",
            namespace,
            "--type",
            "merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )


@pytest.fixture(scope="session")
def monitoring_crds(kube: Kube) -> list[str]:
    """The Prometheus Operator's CRDs (as kube-prometheus-stack installs them), established."""
    return apply_monitoring_crds(kube)


@pytest.fixture(scope="session")
def release(kube: Kube, monitoring_crds: list[str]) -> Iterator[Release]:
    """The chart installed as the README's quick start does, as release `llm-<random>` in a
    namespace of the same name: the chart's ClusterRole is named after the release, so a reused
    cluster never holds one from an earlier session under the same name."""
    namespace = f"llm-{secrets.token_hex(3)}"
    args = ["install", namespace, str(CHART), "--namespace", namespace, "--create-namespace"]
    for value in QUICK_START_SETS:
        args += ["--set", value]
    installed = kube.helm(*args, "--wait", "--timeout", "5m")
    if installed.returncode != 0:
        pytest.fail(f"helm install failed:\n{installed.stdout}\n{installed.stderr}")
    try:
        yield Release(namespace, namespace, installed)
    finally:
        kube.helm("uninstall", namespace, "--namespace", namespace, "--wait", "--timeout", "2m")
        # The operator may be gone: release the finalizers so the namespace can go.
        _remove_finalizers(kube, namespace)
        kube.run("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="session")
def host_operator(kube: Kube, release: Release) -> Iterator[HostOperator]:
    """The operator Deployment's own command and environment, run as a host process that
    authenticates as the chart's ServiceAccount with a TokenRequest token (`launch_operator`);
    the pods' metrics port is a free one instead of vLLM's 8000, so the scrapes of pods on the
    loopback node (test_status_metrics.py) reach only the stand-ins the tests serve."""
    operator = launch_operator(
        kube,
        release.namespace,
        f"{release.fullname}-operator",
        OUT / f"operator-{release.namespace}.log",
    )
    try:
        yield operator
    finally:
        # Delete the ServingPolicies while the operator runs, so it releases its finalizers.
        kube.run(
            "delete",
            "servingpolicies",
            "--all",
            "-n",
            release.namespace,
            "--timeout=60s",
            check=False,
        )
        operator.stop()


@pytest.fixture
def own_operators(
    kube: Kube, release: Release, host_operator: HostOperator
) -> Iterator[Callable[..., HostOperator]]:
    """`start(server=None)` starts another operator as the session's does (each with a token
    of its own, so the audit log tells them apart, and a log `operator-<ns>-own-<n>.log`);
    the session's operator is stopped meanwhile, so only these act. Each is stopped at the end
    and the session's started again (before `make_policy` deletes what the test created)."""
    started: list[HostOperator] = []

    def start(server: str | None = None) -> HostOperator:
        operator = launch_operator(
            kube,
            release.namespace,
            f"{release.fullname}-operator",
            OUT / f"operator-{release.namespace}-own-{len(started)}.log",
            server=server,
            metrics_port=host_operator.metrics_port,
        )
        started.append(operator)
        return operator

    with operator_paused(host_operator):
        try:
            yield start
        finally:
            for operator in started:
                operator.stop()


@pytest.fixture
def make_policy(kube: Kube, release: Release, host_operator: HostOperator) -> Iterator[MakePolicy]:
    """Create a ServingPolicy from the operator's example with `spec` overrides; each is
    deleted (and its deletion awaited, finalizer and all) at the end of the test."""
    ns = release.namespace
    if kube.get("secret", "qwen-arc-api-key", "-n", ns) is None:
        kube.run(
            "create",
            "secret",
            "generic",
            "qwen-arc-api-key",
            "-n",
            ns,
            "--from-literal=api-key=not-a-real-key",
        )
    created: list[str] = []

    def make(name: str, **spec: Any) -> dict[str, Any]:
        body = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
        body["metadata"] = {"name": name, "namespace": ns}
        body["spec"].update(copy.deepcopy(spec))
        kube.run("create", "-f", "-", input=json.dumps(body))
        created.append(name)
        return body

    yield make
    for name in created:
        kube.run("delete", "servingpolicy", name, "-n", ns, "--timeout=60s", check=False)
