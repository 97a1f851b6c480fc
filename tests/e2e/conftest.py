"""Fixtures of the end-to-end tests: the README's used-by path on the local cluster's real node.

The session starts the local cluster with its real node (kubelet, containerd, runc, CNI,
kube-proxy; cluster/README.md) in this session's loopback-only network namespace, imports the
images `make images-local` built into the node's containerd, runs the cluster's DNS and ingress
controller on the node, writes the tiny test model into a folder the pods mount as a hostPath
volume, and stops everything at the end.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster import addons
from cluster.images import ImagesNotBuilt, built_references
from cluster.local import LocalCluster
from tests.cluster.helpers import Kube, ready_pods_matching, wait_for

REPO = Path(__file__).resolve().parents[2]

OUT = REPO / "out" / "e2e"
# The product images the chart deploys here (the GPU engine's cannot be built on this machine).
PRODUCT_IMAGES = ("operator", "vllm-cpu", "router", "loadtest")
START_TIMEOUT_S = 600.0


def product_references() -> dict[str, str]:
    """Image name → reference, as `make images-local` recorded its builds."""
    try:
        return built_references(PRODUCT_IMAGES)
    except ImagesNotBuilt as error:
        pytest.fail(str(error))


def memory_used_bytes() -> int:
    """The machine's memory in use (MemTotal - MemAvailable), as `free` counts it."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class MemoryPeak:
    """The highest memory in use, sampled every second in a thread, above the start's."""

    def __init__(self) -> None:
        self.baseline = self.peak = memory_used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.peak = max(self.peak, memory_used_bytes())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    """Figures the tests measure, written to OUT/figures.json at the end of the session, with
    the session's length and its memory peak above what was in use at its start."""
    found: dict[str, Any] = {}
    started = time.monotonic()
    memory = MemoryPeak()
    yield found
    memory.stop()
    found["session_s"] = round(time.monotonic() - started, 1)
    found["memory_peak_above_start_mib"] = round((memory.peak - memory.baseline) / 2**20)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "figures.json").write_text(json.dumps(found, indent=2, sort_keys=True))


@pytest.fixture(scope="session")
def cluster(figures: dict[str, Any]) -> Iterator[LocalCluster]:
    local = LocalCluster(OUT / "cluster", real_node=True)
    started = time.monotonic()
    created = local.up(timeout=START_TIMEOUT_S)
    figures["cluster_start_s"] = round(time.monotonic() - started, 1)
    try:
        references = product_references()
        started = time.monotonic()
        local.real_node.import_images(list(references.values()))
        figures["image_import_s"] = round(time.monotonic() - started, 1)
        yield local
    finally:
        if created:
            local.down()


@pytest.fixture(scope="session")
def kube(cluster: LocalCluster) -> Iterator[Kube]:
    """kubectl and helm on the cluster; at the end, what a failure would need read is kept in
    OUT/state."""
    client = Kube(cluster, cluster.kubeconfig)
    yield client
    keep_state(client, OUT / "state")


def keep_state(kube: Kube, folder: Path) -> None:
    """Every object of every namespace, the events and each pod's logs, into ``folder``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    kinds = "all,configmaps,servingpolicies,ingresses,jobs,events"
    listed = kube.run("get", kinds, "-A", "-o", "yaml", check=False)
    (folder / "objects.yaml").write_text(listed.stdout + listed.stderr)
    pods = (kube.get("pods", "-A") or {}).get("items", [])
    for pod in pods:
        meta = pod["metadata"]
        logs = kube.run(
            "logs", meta["name"], "-n", meta["namespace"], "--all-containers", "--prefix",
            check=False,
        )  # fmt: skip
        (folder / f"{meta['namespace']}.{meta['name']}.log").write_text(logs.stdout + logs.stderr)


@pytest.fixture(scope="session")
def ingress_url(cluster: LocalCluster, figures: dict[str, Any]) -> str:
    """Cluster DNS and the ingress controller (Traefik) on the real node, as `make cluster`
    runs them (cluster/addons.py); the URL of the ingress Service."""
    started = time.monotonic()
    installed = addons.install(cluster)
    figures["addons_s"] = round(time.monotonic() - started, 1)
    return installed.ingress_url


@pytest.fixture(scope="session")
def model_path(model_dir: Path) -> Path:
    """The tiny model in a folder the node's pods mount (hostPath), readable by any user: the
    engine runs as the image's non-root user."""
    models = OUT / "models"
    shutil.rmtree(models, ignore_errors=True)
    model = Path(shutil.copytree(model_dir, models / "tiny-llama"))
    for path in (models, model, *model.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return models


def wait_ready(kube: Kube, namespace: str, selector: str, count: int, timeout: float) -> list[Any]:
    """The pods matching ``selector`` once ``count`` of them are Ready (none being deleted)."""

    def ready() -> list[Any] | None:
        pods = ready_pods_matching(kube, namespace, selector)
        return pods if len(pods) >= count else None

    return wait_for(f"{count} Ready pods {selector} in {namespace}", ready, timeout=timeout)
