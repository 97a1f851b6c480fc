"""The operator image started against a local Kubernetes control plane (cluster.LocalCluster, in
this test's loopback-only network namespace) with the admin kubeconfig mounted: it lists the
ServingPolicies and builds the children of one that exists before it starts.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from containers import REPO, Bind, Container

from arc_harness.vllm_server import free_port
from cluster.local import LocalCluster

pytestmark = pytest.mark.slow

CRDS = REPO / "charts" / "arc-serving" / "crds"
CLUSTER_OUT = REPO / "out" / "images" / "cluster"
START_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(built_image: Callable[[str], str]) -> Iterator[LocalCluster]:
    """A control plane of its own (out/images/cluster) with the ServingPolicy CRD."""
    built_image("operator")  # skips before a control plane starts for nothing
    local = LocalCluster(out=CLUSTER_OUT)
    started = local.up(timeout=START_TIMEOUT_S)
    try:
        applied = local.kubectl("apply", "-f", str(CRDS))
        assert applied.returncode == 0, applied.stderr
        established = local.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/servingpolicies.arcserving.io",
            "--timeout=60s",
        )
        assert established.returncode == 0, established.stderr
        yield local
    finally:
        if started:
            local.down()


def test_operator_image_lists_servingpolicies_on_a_local_control_plane(
    built_image: Callable[[str], str], cluster: LocalCluster, tmp_path: Path
) -> None:
    namespace = f"image-{secrets.token_hex(3)}"
    policy = {
        "apiVersion": "arcserving.io/v1alpha1",
        "kind": "ServingPolicy",
        "metadata": {"name": "tiny", "namespace": namespace},
        "spec": {
            "model": {"name": "tiny-llama"},
            "image": "ghcr.io/arc-serving/vllm-cpu:0.1.0",
            "policy": "ARC",
            "cache": {"blockSize": 32, "numBlocks": 64},
            "maxModelLen": 1024,
            "routing": {"policy": "none"},
            "apiKeySecretRef": {"name": "tiny-api-key", "key": "api-key"},
        },
    }
    assert cluster.kubectl("create", "namespace", namespace).returncode == 0
    created = cluster.kubectl("apply", "-f", "-", input=json.dumps(policy))
    assert created.returncode == 0, created.stderr
    # The admin kubeconfig with its certificates inline, readable by the image's user.
    flattened = cluster.kubectl("config", "view", "--raw", "--flatten", "--minify")
    assert flattened.returncode == 0, flattened.stderr
    kube = tmp_path / "kube"
    kube.mkdir(mode=0o755)
    (kube / "config").write_text(flattened.stdout)
    (kube / "config").chmod(0o644)
    liveness = free_port()
    args = ["--all-namespaces", f"--liveness=http://127.0.0.1:{liveness}/healthz"]
    env = {"KUBECONFIG": "/var/run/kube/config"}
    with Container(
        built_image("operator"), args=args, env=env, binds=[Bind(kube, "/var/run/kube")]
    ) as operator:
        operator.start()
        deadline = time.monotonic() + 120
        owners: list[str] = []
        while time.monotonic() < deadline and not owners:
            assert operator.running(), f"the operator exited:\n{operator.log()[-4000:]}"
            found = cluster.kubectl("get", "deployment", "tiny", "-n", namespace, "-o", "json")
            if found.returncode == 0:
                references = json.loads(found.stdout)["metadata"].get("ownerReferences", [])
                owners = [r["kind"] for r in references]
            else:
                time.sleep(1)
        assert owners == ["ServingPolicy"], f"no Deployment built:\n{operator.log()[-4000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=10) as ok:
            assert ok.status == 200
    cluster.kubectl("delete", "namespace", namespace, "--wait=false")
