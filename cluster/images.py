"""Images of the local cluster's own tools: one static binary from .tools/bin alone in an empty
image, for the real node's container runtime. They are not the chart's product images
(dev/build_images.py, images/): nothing here is pushed or shipped.

Built with buildah, daemonless, as dev/build_images.py makes the stand-in base: `buildah from
scratch`, the binary copied in root-owned and read-only, the configuration set, committed in
Docker's format. The image carries a label with the hash of everything it is made of (the
binary's bytes included), so a build whose inputs did not change only reads the binary and
returns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RECIPE_LABEL = "org.arc-serving.image-recipe"
# What dev/build_images.py records of each product image it builds (name -> reference, builder,
# base, seconds, size_bytes): the one place its path is written down.
BUILT_IMAGES = Path(__file__).resolve().parents[1] / "out" / "images" / "built.json"


class ImagesNotBuilt(LookupError):
    """A product image was asked for that `make images-local` has not built here."""


def built_images() -> dict[str, dict[str, Any]]:
    """Each product image built here, by name (empty when none was)."""
    if not BUILT_IMAGES.is_file():
        return {}
    return dict(json.loads(BUILT_IMAGES.read_text(encoding="utf-8")))


def built_references(names: Sequence[str]) -> dict[str, str]:
    """Image name -> reference for ``names``; ImagesNotBuilt names those missing."""
    built = built_images()
    missing = [name for name in names if name not in built]
    if missing:
        raise ImagesNotBuilt(
            f"images not built here: {missing} ({BUILT_IMAGES}; make images-local)"
        )
    return {name: str(built[name]["reference"]) for name in names}


def _buildah(*args: str) -> str:
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"buildah {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def image_labels(reference: str) -> dict[str, str] | None:
    """The labels of the image in buildah's storage, or None when there is no such image."""
    inspected = subprocess.run(
        ["buildah", "inspect", "--type", "image", reference],
        capture_output=True,
        text=True,
        check=False,
    )
    if inspected.returncode != 0:
        return None
    config: dict[str, Any] = json.loads(inspected.stdout)["OCIv1"]["config"]
    return dict(config.get("Labels") or {})


def binary_image(
    binary: Path,
    reference: str,
    *,
    path: str,
    user: int,
    ports: Sequence[str] = (),
    labels: Mapping[str, str] | None = None,
) -> bool:
    """``binary`` alone at ``path`` in an empty image tagged ``reference``, run as
    ``user:user``, its entrypoint; True when it was built, False when the image in buildah's
    storage was made from the same inputs."""
    if shutil.which("buildah") is None:
        raise SystemExit("buildah is not installed (make image-tools)")
    if not binary.is_file():
        raise SystemExit(f"no {binary}: build it first (make cluster-binaries)")
    recipe_inputs = {
        "binary_sha256": hashlib.sha256(binary.read_bytes()).hexdigest(),
        "path": path,
        "user": user,
        "ports": list(ports),
        "labels": dict(labels or {}),
    }
    recipe = hashlib.sha256(json.dumps(recipe_inputs, sort_keys=True).encode()).hexdigest()[:16]
    if (image_labels(reference) or {}).get(RECIPE_LABEL) == recipe:
        return False
    container = _buildah("from", "scratch")
    try:
        _buildah("copy", "--chown", "0:0", "--chmod", "0555", container, str(binary), path)
        settings = [
            "--entrypoint",
            json.dumps([path]),
            "--user",
            f"{user}:{user}",
            "--workingdir",
            "/",
            *(arg for port in ports for arg in ("--port", port)),
            *(arg for k, v in (labels or {}).items() for arg in ("--label", f"{k}={v}")),
            "--label",
            f"{RECIPE_LABEL}={recipe}",
        ]
        _buildah("config", *settings, container)
        # Docker's format, as dev/build_images.py commits: the node's containerd takes either.
        _buildah("commit", "--quiet", "--format", "docker", container, reference)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
    return True


def image_size(reference: str) -> str:
    """The image's size as buildah reports it ("178 MB")."""
    listed = json.loads(_buildah("images", "--json", reference))
    return str(listed[0]["size"])


def build_and_report(reference: str, build: Callable[[], bool]) -> None:
    """Build an image (``build`` returns whether it had to) and print its state and size."""
    started = time.monotonic()
    built = build()
    state = f"built in {time.monotonic() - started:.1f} s" if built else "current"
    print(f"{reference}: {state}, {image_size(reference)}")


def addon_main(
    argv: Sequence[str] | None,
    *,
    prog: str,
    what: str,
    image: str,
    build_image: Callable[[str], bool],
    manifests: Callable[[str], list[dict[str, Any]]],
) -> int:
    """An add-on's command line: ``image`` builds its image, ``manifests`` prints its objects
    as a JSON List; ``--image`` names the reference."""
    parser = argparse.ArgumentParser(
        prog=prog, description=f"The {what}'s image (image) or manifests (manifests, a JSON List)."
    )
    parser.add_argument("command", choices=["image", "manifests"])
    parser.add_argument("--image", default=image, help="the image reference")
    args = parser.parse_args(argv)
    if args.command == "manifests":
        items = manifests(args.image)
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
    else:
        build_and_report(args.image, lambda: build_image(args.image))
    return 0
