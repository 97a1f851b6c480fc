"""Run a built image as a container: its root filesystem from buildah's storage, run by runc.

The container is set up as a Kubernetes pod with the chart's hardening would run it: the
image's entrypoint, command, environment, user and working directory; a read-only root, every
capability dropped, no new privileges, writable tmpfs only at /tmp, the home folder and
/dev/shm; its own PID, IPC, UTS and mount namespaces. It has no network namespace of its own:
it shares the caller's, which in the tests is loopback-only, so the test reaches it on
127.0.0.1 and it reaches nothing off this machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# runc's state for these containers only, apart from any other runc user on the machine.
RUNC_ROOT = Path("/run/arc-serving-image-tests")
HOME_SIZE = "2g"


def runner_missing() -> str | None:
    """Why images cannot be run here, or None."""
    for tool in ("buildah", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (`make image-tools`)"
    if os.geteuid() != 0:
        return "running images with runc needs root"
    return None


def skip_unless_runnable(image: str, built_by: str) -> None:
    """Skip the test, saying why, where images cannot run here or ``image`` is not built."""
    missing = runner_missing()
    if missing:
        pytest.skip(f"cannot run images here: {missing}")
    if subprocess.run(["buildah", "inspect", image], capture_output=True).returncode != 0:
        pytest.skip(f"no {image} here: `{built_by}` builds it")


@dataclass(frozen=True)
class Bind:
    source: Path
    destination: str
    writable: bool = False


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: list[str]
    cmd: list[str]
    env: list[str]
    user: str
    workdir: str
    labels: dict[str, str]


def image_config(reference: str) -> ImageConfig:
    inspected = subprocess.run(
        ["buildah", "inspect", "--type", "image", reference],
        capture_output=True,
        text=True,
        check=True,
    )
    config = json.loads(inspected.stdout)["OCIv1"]["config"]
    return ImageConfig(
        entrypoint=config.get("Entrypoint") or [],
        cmd=config.get("Cmd") or [],
        env=config.get("Env") or [],
        user=config.get("User") or "",
        workdir=config.get("WorkingDir") or "/",
        labels=config.get("Labels") or {},
    )


def numeric_user(user: str, rootfs: Path) -> tuple[int, int]:
    """USER as (uid, gid): numbers as given, a name from the image's own /etc/passwd."""
    name, _, group = user.partition(":")
    if not name:
        return 0, 0
    if name.isdigit():
        uid = int(name)
        gid = int(group) if group.isdigit() else uid
        return uid, gid
    for line in (rootfs / "etc" / "passwd").read_text(encoding="utf-8").splitlines():
        fields = line.split(":")
        if fields[0] == name:
            return int(fields[2]), int(group) if group.isdigit() else int(fields[3])
    raise LookupError(f"user {name!r} is not in the image's /etc/passwd")


def _runtime_spec(
    rootfs: Path,
    args: Sequence[str],
    env: Sequence[str],
    uid: int,
    gid: int,
    cwd: str,
    home: str,
    binds: Sequence[Bind],
) -> dict[str, Any]:
    no_capabilities: dict[str, list[str]] = {
        kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")
    }
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1g"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        {
            "destination": "/tmp",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777", "size=2g"],
        },
    ]
    if home not in {"", "/"}:
        mounts.append(
            {
                "destination": home,
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [
                    "nosuid",
                    "nodev",
                    "mode=0755",
                    f"uid={uid}",
                    f"gid={gid}",
                    f"size={HOME_SIZE}",
                ],
            }
        )
    mounts += [
        {
            "destination": bind.destination,
            "type": "bind",
            "source": str(bind.source),
            "options": ["rbind", "rw" if bind.writable else "ro", "nosuid", "nodev"],
        }
        for bind in binds
    ]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": list(args),
            "env": list(env),
            "cwd": cwd,
            "capabilities": no_capabilities,
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "image-test",
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": [
                "/proc/bus",
                "/proc/fs",
                "/proc/irq",
                "/proc/sys",
                "/proc/sysrq-trigger",
            ],
        },
    }


@dataclass
class Container:
    """One run of `reference`; a context manager. `args` replaces the image's command (CMD),
    `entrypoint` its entrypoint, `env` adds to its environment."""

    reference: str
    args: Sequence[str] | None = None
    entrypoint: Sequence[str] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    binds: Sequence[Bind] = ()
    log_path: Path | None = None
    name: str = field(default_factory=lambda: f"image-test-{secrets.token_hex(4)}")
    config: ImageConfig | None = None
    uid: int = -1
    gid: int = -1
    rootfs: Path | None = None
    _working: str | None = None
    _bundle: tempfile.TemporaryDirectory[str] | None = None
    _process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Container:
        self.config = image_config(self.reference)
        self._working = subprocess.run(
            ["buildah", "from", "--pull-never", "--name", self.name, self.reference],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        try:
            mounted = subprocess.run(
                ["buildah", "mount", self._working], capture_output=True, text=True, check=True
            )
            self.rootfs = Path(mounted.stdout.strip())
            self.uid, self.gid = numeric_user(self.config.user, self.rootfs)
        except BaseException:
            self._remove_working_container()
            raise
        return self

    def command(self) -> list[str]:
        assert self.config is not None
        entrypoint = self.config.entrypoint if self.entrypoint is None else self.entrypoint
        args = self.config.cmd if self.args is None else self.args
        return [*entrypoint, *args]

    def environment(self) -> list[str]:
        assert self.config is not None
        env = dict(line.split("=", 1) for line in self.config.env)
        env.update(self.env)
        return [f"{key}={value}" for key, value in env.items()]

    def start(self) -> subprocess.Popen[bytes]:
        """Start the container's process under runc, its output to `log_path`."""
        assert self.config is not None and self.rootfs is not None
        self._bundle = tempfile.TemporaryDirectory(prefix="image-test-bundle-")
        bundle = Path(self._bundle.name)
        home = dict(line.split("=", 1) for line in self.environment()).get("HOME", "")
        spec = _runtime_spec(
            self.rootfs,
            self.command(),
            self.environment(),
            self.uid,
            self.gid,
            self.config.workdir,
            home,
            self.binds,
        )
        (bundle / "config.json").write_text(json.dumps(spec), encoding="utf-8")
        if self.log_path is None:
            self.log_path = bundle / "container.log"
        RUNC_ROOT.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                ["runc", "--root", str(RUNC_ROOT), "run", "--bundle", str(bundle), self.name],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self._process

    def run(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run to completion; the exit status and the output (stdout and stderr together)."""
        process = self.start()
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(process.args, returncode, self.log(), "")

    def log(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM the container's process, SIGKILL it after the grace period, delete it."""
        if self._process is None:
            return
        if self._process.poll() is None:
            subprocess.run(
                ["runc", "--root", str(RUNC_ROOT), "kill", self.name, "TERM"],
                capture_output=True,
                check=False,
            )
            deadline = time.monotonic() + grace_s
            while self._process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        subprocess.run(
            ["runc", "--root", str(RUNC_ROOT), "delete", "--force", self.name],
            capture_output=True,
            check=False,
        )
        self._process.wait(timeout=30)

    def _remove_working_container(self) -> None:
        if self._working is not None:
            subprocess.run(["buildah", "umount", self._working], capture_output=True, check=False)
            subprocess.run(["buildah", "rm", self._working], capture_output=True, check=False)
            self._working = None

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._remove_working_container()
            if self._bundle is not None:
                self._bundle.cleanup()
