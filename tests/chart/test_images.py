"""The Dockerfiles under images/: pinned bases (no `latest`), a non-root final user, pinned
packages, and the Makefile builds each of them; the router image runs the tested router.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from chart_helpers import REPO, render

from arc_operator.__main__ import parse_args

IMAGES = sorted((REPO / "images").glob("*.Dockerfile"))
PINNED_TAG = re.compile(r"^[\w./-]+:[\w.-]*\d[\w.-]*(@sha256:[0-9a-f]{64})?( AS \w+)?$")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = path.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
    return result


def test_the_five_images_exist() -> None:
    assert [path.name for path in IMAGES] == [
        "loadtest.Dockerfile",
        "operator.Dockerfile",
        "router.Dockerfile",
        "vllm-cpu.Dockerfile",
        "vllm.Dockerfile",
    ]


def test_router_image_installs_the_tested_router_and_runs_it_without_a_shell() -> None:
    steps = instructions(REPO / "images" / "router.Dockerfile")
    installs = " ".join(args for keyword, args in steps if keyword == "RUN")
    # The version the dev venv runs (docs/architecture.md, "Routing").
    assert '"vllm-router==0.1.17"' in installs
    assert ("USER", "10001:10001") in steps
    (entrypoint,) = [args for keyword, args in steps if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["vllm-router"], "exec form, no shell"
    assert not [args for keyword, args in steps if keyword in {"COPY", "ADD"}]
    ignore = (REPO / "images" / "router.Dockerfile.dockerignore").read_text(encoding="utf-8")
    rules = [line for line in ignore.splitlines() if line and not line.startswith("#")]
    assert rules == ["*"], "the build context admits nothing of the source tree"


def test_operator_image_and_chart_run_the_operator_wheels_entry_point() -> None:
    (deployment,) = [
        o
        for o in render()
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    (command,) = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    project = tomllib.loads((REPO / "operator" / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["scripts"][command] == "arc_operator.__main__:main"
    steps = instructions(REPO / "images" / "operator.Dockerfile")
    (entrypoint,) = [args for keyword, args in steps if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == [command], "exec form, no shell"
    # The image's default arguments, parsed by the operator itself: one copy, no election.
    (cmd,) = [args for keyword, args in steps if keyword == "CMD"]
    options = parse_args(json.loads(cmd), env={})
    assert options.all_namespaces and options.lease_name is None


def base_arguments(steps: list[tuple[str, str]]) -> dict[str, str]:
    """The defaults of the ARGs declared before the first FROM, which FROM lines may name."""
    defaults = {}
    for keyword, args in steps:
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in args:
            name, _, value = args.partition("=")
            defaults[name] = value.strip('"')
    return defaults


@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.stem)
def test_every_base_image_is_pinned(path: Path) -> None:
    steps = instructions(path)
    defaults = base_arguments(steps)
    bases = [
        re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], args)
        for keyword, args in steps
        if keyword == "FROM"
    ]
    assert bases
    for base in bases:
        assert "latest" not in base, base
        assert PINNED_TAG.match(base), f"{path.name}: unpinned base {base!r}"


@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.stem)
def test_final_stage_runs_as_non_root(path: Path) -> None:
    steps = instructions(path)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    users = [args for keyword, args in steps[last_from:] if keyword == "USER"]
    assert users, f"{path.name}: the final stage never sets USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, path.name


@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.stem)
def test_installed_packages_are_pinned(path: Path) -> None:
    for keyword, args in instructions(path):
        if keyword != "RUN":
            continue
        for command in re.split(r"&&", args):
            words = command.split()
            if "install" not in words:
                continue
            if words[0] in {"apt-get"}:
                packages = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
                assert packages and all("=" in p for p in packages), command
            if "pip" in words[:4]:
                packages = [
                    w.strip('"')
                    for w in words[words.index("install") + 1 :]
                    if not w.startswith("-") and "arc_serving" not in w and "whl" not in w
                ]
                assert all("==" in p for p in packages), command


def test_make_images_builds_every_dockerfile() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    listed = re.search(r"^IMAGES := (.+)$", makefile, flags=re.MULTILINE)
    assert listed
    built = sorted(listed.group(1).split())
    assert built == sorted(path.name.removesuffix(".Dockerfile") for path in IMAGES)
