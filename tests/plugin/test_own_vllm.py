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
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from arc_harness.vllm_server import cpu_dtype, cpu_engine_environment, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SECTION = "## The plugin in your own vLLM"
BUILD_WHEELS = Path(sys.prefix) / "build-wheels"
# This project's distributions (and their editable-install hooks): left out of the user's venv.
OWN = re.compile(r"^(__editable__\.)?(arc_evictor|arc_serving_\w+)[-.]")
BLOCK = 32
START_TIMEOUT_S = 600.0


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


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    if not any(BUILD_WHEELS.glob("setuptools-*.whl")):
        pytest.fail(f"no build requirements in {BUILD_WHEELS}: `make test` fetches them")
    install, serve, read = readme_commands()
    port = free_port()
    cpu_args = (
        f"{model_dir} --served-model-name tiny --host 127.0.0.1 --port {port} "
        f"--block-size {BLOCK} --max-model-len 1024 --num-gpu-blocks-override 64 "
        f"--dtype {cpu_dtype()} --enforce-eager"
    )
    assert " MODEL " in serve and "localhost:8000" in read, (serve, read)
    bin_dir = make_vllm_environment(tmp_path_factory.mktemp("user") / "venv")
    env = cpu_engine_environment(tmp_path_factory.mktemp("unused"), 1, True)
    for name in ("PROMETHEUS_MULTIPROC_DIR", "VIRTUAL_ENV", "PYTHONPATH", "VLLM_API_KEY"):
        env.pop(name, None)  # the README's line sets the first; the others are the dev venv's
    env |= {
        "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(BUILD_WHEELS),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    yield {
        "install": install,
        "serve": serve.replace(" MODEL ", f" {cpu_args} ", 1),
        "read": read.replace("localhost:8000", f"127.0.0.1:{port}"),
        "env": env,
        "python": bin_dir / "python",
        "base_url": f"http://127.0.0.1:{port}",
        "log": tmp_path_factory.mktemp("log") / "server.log",
    }


def bash(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )


def wait_healthy(process: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the server did not answer /health in {START_TIMEOUT_S:.0f} s")


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


def test_readme_lines_install_the_plugin_into_a_vllm_environment_and_show_it_working(
    commands: dict,
) -> None:
    env, python = commands["env"], commands["python"]
    installed = bash(commands["install"], env)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The wheel's compiled core, not the checkout's sources.
    where = subprocess.run(
        [python, "-c", "import arc_evictor.policies.arc as m; print(m.__file__)"],
        cwd="/", env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(str(python.parent.parent)) and where.endswith(".so"), where

    with open(commands["log"], "wb") as log:
        server = subprocess.Popen(
            ["bash", "-c", commands["serve"]],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_healthy(server, commands["base_url"], commands["log"])
        shown = bash(commands["read"], env)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines() == ['arc_evictor_policy_info{policy="arc"} 1.0'], (
            shown.stdout
        )
        # The same prompt twice: the second reads the first's four blocks from the cache. The
        # plugin publishes its counts at the next scheduler step: a third request makes one.
        prompt = [4 + i % 1000 for i in range(4 * BLOCK + 1)]
        for tokens in (prompt, prompt, [5]):
            complete(commands["base_url"], tokens)
        assert block_hits(commands["base_url"]) == 4
    finally:
        stop(server)


def stop(server: subprocess.Popen[bytes]) -> None:
    """Stop the server's process group (bash, the API server, the engine core)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
            server.wait(timeout=60)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
