"""The serving pod template is locked down, and vLLM only writes where the pod lets it.

The manifest checks are plain assertions over ``manifests.pod_template``. The real-vLLM check
starts the CPU server with the pod's environment and volume layout mapped into a temporary
directory (each volume mount becomes a directory named after its volume) and records every
file-system write of every Python process through an audit hook
(``write_audit/sitecustomize.py``): each one must land in a writable emptyDir. Without
containers the root filesystem cannot be made read-only here, so this is the check that the
layout covers what vLLM 0.32 writes.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from arc_harness.vllm_server import VllmServer
from arc_operator import manifests
from arc_operator.models import OWNED_ENV, WRITABLE_DIR_ENV, SpecError, parse_spec
from arc_serving_common.names import CONFIG_ENV
from tests.operator.conftest import make_spec

ROOT = Path(__file__).resolve().parents[2]
AUDIT_DIR = Path(__file__).resolve().parent / "write_audit"
SERVING_IMAGES = ("vllm.Dockerfile", "vllm-cpu.Dockerfile")
# Paths a process may write outside the pod's volumes: the null device and shared memory
# (/dev/shm is the pod's memory-backed emptyDir, the same path on this machine).
DEVICE_WRITES = ("/dev/null", "/dev/shm/")


def pod(mode: str = "Hot") -> dict[str, Any]:
    return manifests.pod_template("demo", parse_spec(make_spec(switchMode=mode)))


def container_of(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


def image_user(dockerfile: str) -> int:
    """The uid the final stage of an image runs as (its last ``USER uid:gid`` line)."""
    text = (ROOT / "images" / dockerfile).read_text(encoding="utf-8")
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", text, flags=re.MULTILINE)
    assert users, f"{dockerfile} has no numeric USER uid:gid line"
    uid, gid = users[-1]
    assert uid == gid, f"{dockerfile}: user and group differ"
    return int(uid)


@pytest.mark.parametrize("mode", ["Hot", "Restart"])
def test_serving_pod_runs_non_root_with_every_privilege_dropped(mode: str) -> None:
    template = pod(mode)
    security = template["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert template["spec"]["automountServiceAccountToken"] is False
    assert container_of(template)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


@pytest.mark.parametrize("dockerfile", SERVING_IMAGES)
def test_pod_user_is_the_serving_images_user(dockerfile: str) -> None:
    security = pod()["spec"]["securityContext"]
    uid = image_user(dockerfile)
    assert security["runAsUser"] == security["runAsGroup"] == security["fsGroup"] == uid


def test_every_writable_mount_is_an_empty_dir_and_only_config_is_read_only() -> None:
    template = pod()
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    for mount in container_of(template)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if mount.get("readOnly"):
            assert "configMap" in volume, mount
        else:
            assert set(volume) == {"name", "emptyDir"}, f"{mount} is writable but not scratch"
    # Disk-backed scratch is capped where its size is known (HOME may hold a downloaded model).
    assert volumes["tmp"]["emptyDir"]["sizeLimit"] == manifests.TMP_SIZE_LIMIT
    assert volumes["prometheus"]["emptyDir"]["sizeLimit"] == manifests.METRICS_SIZE_LIMIT


@pytest.mark.parametrize("mode", ["Hot", "Restart"])
def test_every_directory_variable_points_into_a_writable_empty_dir(mode: str) -> None:
    template = pod(mode)
    container = container_of(template)
    writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    env = {var["name"]: var.get("value") for var in container["env"]}
    for name in [*manifests.WRITABLE_DIRS_ENV, manifests.METRICS_DIR_ENV]:
        path = env[name]
        assert any(path == m or path.startswith(m + "/") for m in writable), (name, path)
    # Set before any user variable, so that user values can refer to them as $(HOME).
    names = [var["name"] for var in container["env"]]
    assert names[: len(manifests.WRITABLE_DIRS_ENV)] == list(manifests.WRITABLE_DIRS_ENV)


def test_directory_variables_are_owned_by_the_operator() -> None:
    assert set(manifests.WRITABLE_DIRS_ENV) == WRITABLE_DIR_ENV
    assert WRITABLE_DIR_ENV <= OWNED_ENV
    with pytest.raises(SpecError, match="env may not set HOME, TMPDIR"):
        parse_spec(
            make_spec(env=[{"name": "TMPDIR", "value": "/x"}, {"name": "HOME", "value": "/"}])
        )


def test_unset_cpu_and_memory_get_the_defaults_so_no_pod_runs_unbounded() -> None:
    spec = parse_spec(make_spec(resources={"gpus": 0}))
    template = manifests.pod_template("demo", spec)
    assert container_of(template)["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"cpu": "4", "memory": "32Gi"},
    }
    # HOME (model downloads, caches) is capped too: the default, or the spec's value.
    volumes = {volume["name"]: volume for volume in template["spec"]["volumes"]}
    assert volumes["home"]["emptyDir"] == {"sizeLimit": "64Gi"}
    sized_home = parse_spec(make_spec(resources={"gpus": 0, "homeSizeLimit": "20Gi"}))
    volumes = {v["name"]: v for v in manifests.pod_template("demo", sized_home)["spec"]["volumes"]}
    assert volumes["home"]["emptyDir"] == {"sizeLimit": "20Gi"}
    with pytest.raises(SpecError, match=r"spec\.resources\.homeSizeLimit"):
        parse_spec(make_spec(resources={"gpus": 0, "homeSizeLimit": "lots"}))
    sized = container_of(pod())["resources"]
    assert sized["requests"] == {"cpu": "4", "memory": "16Gi"}
    assert sized["limits"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}


# --- the real vLLM server with the pod's layout -------------------------------------------


def mapped_layout(template: dict[str, Any], root: Path) -> tuple[dict[str, str], list[Path]]:
    """The container's directory variables remapped under ``root``, and the writable dirs.

    Each mount (but /dev/shm, which exists here as in the pod) becomes ``root/<volume name>``.
    """
    container = container_of(template)
    mounts = {
        m["mountPath"]: (root / m["name"], not m.get("readOnly"))
        for m in container["volumeMounts"]
        if m["mountPath"] != "/dev/shm"
    }
    for host, _ in mounts.values():
        host.mkdir(parents=True)

    def remap(path: str) -> str:
        for mount, (host, _) in mounts.items():
            if path == mount or path.startswith(mount + "/"):
                return str(host) + path.removeprefix(mount)
        raise AssertionError(f"{path} is on the root filesystem, not in a volume")

    env = {
        var["name"]: remap(var["value"])
        for var in container["env"]
        if var["name"] in {*manifests.WRITABLE_DIRS_ENV, manifests.METRICS_DIR_ENV}
        or var["name"] == CONFIG_ENV
    }
    writable = [host for host, is_writable in mounts.values() if is_writable]
    return env, writable


def outside(path: str, writable: list[Path], audit_log: Path) -> bool:
    if path == str(audit_log) or path.startswith(DEVICE_WRITES):
        return False
    # CPython caches bytecode next to the sources and ignores a read-only directory.
    if path.endswith(".pyc") or "/__pycache__/" in path:
        return False
    return not any(Path(path).is_relative_to(host) for host in writable)


@pytest.fixture
def pod_root() -> Iterator[Path]:
    """A short directory for the pod's volumes: vLLM binds its engine's ZeroMQ sockets under
    TMPDIR (the pod's /tmp volume), and a Unix socket's path may not exceed 107 bytes, which a
    pytest-xdist worker's tmp_path can come close to."""
    with tempfile.TemporaryDirectory(prefix="pod-") as root:
        yield Path(root)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_writes_only_into_the_pods_empty_dirs(
    model_dir: Path, tmp_path: Path, pod_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Importing torch (the model builder did) records its compile cache dir in os.environ;
    # the server would inherit this process's /tmp path, which no pod has.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    template = pod("Hot")
    env, writable = mapped_layout(template, pod_root)
    (Path(env[CONFIG_ENV]).parent / manifests.CONFIG_KEY).write_text(json.dumps({"policy": "arc"}))
    audit_log = tmp_path / "writes.log"
    env["ARC_WRITE_AUDIT_LOG"] = str(audit_log)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(AUDIT_DIR), os.environ.get("PYTHONPATH")])
    )
    with VllmServer(model_dir, served_model_name="tiny", env=env) as server:
        body = json.dumps({"model": "tiny", "prompt": [5] * 40, "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"{server.base_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", **server.auth_headers},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
            metrics = response.read()
    assert b"arc_evictor_policy_info" in metrics, "the plugin ran with the pod's layout"
    writes = [line.split("\t", 1) for line in audit_log.read_text().splitlines()]
    assert writes, "the audit hook recorded nothing: it did not load"
    stray = sorted(
        {f"{event} {path}" for event, path in writes if outside(path, writable, audit_log)}
    )
    assert not stray, f"vLLM wrote outside the pod's emptyDirs: {stray}"
    # The layout is the one in use: the engine wrote its metrics and caches there.
    home, metrics_dir = Path(env["HOME"]), Path(env[manifests.METRICS_DIR_ENV])
    assert any(Path(path).is_relative_to(home) for _, path in writes)
    assert any(metrics_dir.iterdir())
