"""The README's "The plugin in your own vLLM", run as written in a vLLM environment that holds
none of this project: ``pip install`` from the checkout (pip's build isolation compiles the
policy core), the server with a policy, and the ``curl`` that shows the plugin's metrics.

The environment is a new virtualenv whose site-packages links to the dev venv's entries
(vLLM's CPU build and its dependencies) except this project's distributions; pip gets the
build requirements from the wheels ``make test`` fetched (``BUILD_WHEELS`` in the Makefile)
instead of an index, which is out of reach here. The README's ``MODEL`` is the tiny local
model, given the arguments the CPU build needs on this machine, and ``localhost:8000`` the
server's free port.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest

from arc_harness.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SECTION = "## The plugin in your own vLLM"
BUILD_WHEELS = Path(sys.prefix) / "build-wheels"
# This project's distributions (and their editable-install hooks): left out of the user's venv.
OWN = re.compile(r"^(__editable__\.)?(arc_evictor|arc_serving_\w+)[-.]")
BLOCK = 32


def readme_commands() -> list[str]:
    """The commands of the section's shell block, continuation lines joined."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index(SECTION) :]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, f"no sh block under {SECTION!r}"
    return [c.strip() for c in block.group(1).replace("\\\n", " ").splitlines() if c.strip()]


def make_vllm_environment(path: Path) -> Path:
    """A new venv at ``path`` with the dev venv's packages but none of this project's; its
    ``bin`` directory, to put first on PATH."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    target = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if not OWN.match(entry.name) and not (target / entry.name).exists():
            (target / entry.name).symlink_to(entry.resolve())
    return path / "bin"


def as_user(env: dict[str, str], bin_dir: Path) -> dict[str, str]:
    """``env`` as the user's shell has it: their venv's ``bin`` first on PATH, none of the dev
    venv's, and pip's packages from the fetched wheels instead of an index."""
    user = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return user | {
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(BUILD_WHEELS),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


class ReadmeServer(VllmServer):
    """The README's server line, run by bash in the user's venv and started, waited for and
    stopped as the harness's own server. ``MODEL`` becomes the tiny model followed by the
    arguments the harness gives vLLM's CPU build here (port, block size, cache, dtype)."""

    def __init__(self, line: str, model_dir: Path, bin_dir: Path, log_path: Path) -> None:
        super().__init__(model_dir, block_size=BLOCK, num_gpu_blocks=64, max_model_len=1024,
                         served_model_name="tiny", log_path=log_path, api_key=None)  # fmt: skip
        assert " MODEL " in line, line
        self.line, self.bin_dir = line, bin_dir

    def command(self) -> list[str]:
        harness = super().command()[3:]  # after python -m MODULE
        at = harness.index("--model")
        model = [harness.pop(at + 1), *harness[:at], *harness[at + 1 :]]
        return ["bash", "-c", self.line.replace(" MODEL ", f" {shlex.join(model)} ", 1)]

    def environment(self) -> dict[str, str]:
        # The CPU build's settings; the README's line sets its own PROMETHEUS_MULTIPROC_DIR.
        return as_user(super().environment(), self.bin_dir)


def complete(base_url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    request = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200


def block_hits(base_url: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    (line,) = (
        line for line in text.splitlines() if line.startswith("arc_evictor_block_hits_total")
    )
    return float(line.split()[-1])


def bash(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )


def test_readme_lines_install_the_plugin_into_a_vllm_environment_and_show_it_working(
    model_dir: Path, tmp_path: Path
) -> None:
    if not any(BUILD_WHEELS.glob("setuptools-*.whl")):
        pytest.fail(f"no build requirements in {BUILD_WHEELS}: `make test` fetches them")
    install, serve, read = readme_commands()
    assert "localhost:8000" in read, read
    bin_dir = make_vllm_environment(tmp_path / "venv")
    env = as_user(dict(os.environ), bin_dir)
    installed = bash(install, env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The wheel's compiled core, not the checkout's sources.
    where = subprocess.run(
        [bin_dir / "python", "-c", "import arc_evictor.policies.arc as m; print(m.__file__)"],
        cwd="/", env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(str(bin_dir.parent)) and where.endswith(".so"), where

    with ReadmeServer(serve, model_dir, bin_dir, tmp_path / "server.log") as server:
        shown = bash(read.replace("localhost:8000", f"127.0.0.1:{server.port}"), env)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines() == ['arc_evictor_policy_info{policy="arc"} 1.0'], (
            shown.stdout
        )
        # The same prompt twice: the second reads the first's four blocks from the cache. The
        # plugin publishes its counts at the next scheduler step: a third request makes one.
        prompt = [4 + i % 1000 for i in range(4 * BLOCK + 1)]
        for tokens in (prompt, prompt, [5]):
            complete(server.base_url, tokens)
        assert block_hits(server.base_url) == 4
