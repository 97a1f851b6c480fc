"""Each built image, run as a container (runc, in this test's loopback-only network namespace):
its entrypoint answers, it runs as a non-root user, holds no compiler and only the wheels it
should; the serving image serves the tiny model with the plugin, the load-test image replays a
trace against it, the operator image starts against a local control plane.

`make images-local` (or `make images`) builds what these tests run; out/images/built.json says
which images were built, and a test whose image was not skips naming the target.
"""

from __future__ import annotations

import json
import secrets
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from containers import Bind, Container

from arc_harness.vllm_server import free_port
from arc_serving_common.names import POLICY_ENV

pytestmark = pytest.mark.slow

PYTHON_IMAGES = ("vllm-cpu", "operator", "loadtest", "router")
# The distributions of this repository each image must hold, and no other of them.
OWN_DISTRIBUTIONS = {
    "vllm-cpu": {"arc-evictor", "arc-serving-common"},
    "operator": {"arc-serving-operator", "arc-serving-common"},
    "loadtest": {"arc-serving-loadtest", "arc-serving-common"},
    "router": set(),
}
# Where the operator's serving pods keep the Prometheus multiprocess files.
METRICS_DIR = "/var/run/arc-evictor/prometheus"
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "clang++", "tcc", "x86_64-linux-gnu-gcc-12")

# Run inside each image as its own user: who it is, which of this repository's distributions
# are installed, which compilers its PATH finds, and every wheel file left in the filesystem.
PROBE = """
import json, os, shutil
from importlib import metadata
own = sorted({d.metadata["Name"] for d in metadata.distributions()
              if d.metadata["Name"].startswith(("arc-evictor", "arc-serving"))})
wheels = [os.path.join(root, f) for top in ("/usr", "/opt", "/tmp", "/app", "/home", "/src")
          for root, _, files in os.walk(top) for f in files if f.endswith(".whl")
          and "/site-packages/pip/" not in root and "python-wheels" not in root]
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "own": own, "wheels": wheels,
                  "compilers": [c for c in %r if shutil.which(c)]}))
""" % (COMPILERS,)  # noqa: UP031 - the probe's source holds braces


@pytest.mark.parametrize("name", PYTHON_IMAGES)
def test_image_runs_as_non_root_without_compiler_and_only_its_own_wheels(
    built_image: Callable[[str], str], name: str
) -> None:
    with Container(built_image(name), entrypoint=["python3", "-c", PROBE], args=[]) as container:
        ran = container.run(timeout=120)
        assert container.config is not None
        configured_user = container.config.user
    assert ran.returncode == 0, ran.stdout
    found = json.loads(ran.stdout.strip().splitlines()[-1])
    assert configured_user == "10001:10001"
    assert (found["uid"], found["gid"]) == (10001, 10001)
    assert found["compilers"] == [], f"{name}: a compiler in the final stage"
    assert set(found["own"]) == OWN_DISTRIBUTIONS[name]
    assert found["wheels"] == [], f"{name}: wheel files left in the image"


def test_operator_image_help(built_image: Callable[[str], str]) -> None:
    with Container(built_image("operator"), args=["--help"]) as container:
        ran = container.run(timeout=120)
    assert ran.returncode == 0, ran.stdout
    assert "usage: arc-operator" in ran.stdout
    assert "--all-namespaces" in ran.stdout


def test_router_image_help_lists_kv_aware(built_image: Callable[[str], str]) -> None:
    with Container(built_image("router")) as container:  # the image's CMD is --help
        ran = container.run(timeout=120)
    assert ran.returncode == 0, ran.stdout
    assert "kv_aware" in ran.stdout


def test_loadtest_image_help(built_image: Callable[[str], str]) -> None:
    # Locust's help lists its own options only; the replay below runs the trace options.
    with Container(built_image("loadtest")) as container:  # the image's CMD is --help
        ran = container.run(timeout=120)
    assert ran.returncode == 0, ran.stdout
    assert ran.stdout.startswith("Usage: locust") and "--headless" in ran.stdout


def fetch(url: str, headers: dict[str, str] | None = None, body: Any = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, log: Callable[[], str]
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s:.0f} s waiting for {what}; log:\n{log()[-4000:]}"
            )
        time.sleep(1)


class Serving:
    def __init__(self, container: Container, base_url: str, api_key: str) -> None:
        self.container = container
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="module")
def serving(
    built_image: Callable[[str], str], model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Serving]:
    """The vllm-cpu image serving the tiny model from a mounted read-only folder with
    ARC_EVICTOR_POLICY=arc, as the chart's pod runs it (read-only root, home and /tmp on
    tmpfs), on a free port of this namespace's loopback."""
    reference = built_image("vllm-cpu")
    models = tmp_path_factory.mktemp("image-models")
    model = shutil.copytree(model_dir, models / "tiny-llama")
    for path in (models, *model.rglob("*"), model):
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = free_port()
    api_key = secrets.token_urlsafe(24)
    args = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        "/models/tiny-llama",
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "2016",
        "--enforce-eager",
        # bfloat16 stops the engine with SIGILL in vLLM's CPU attention kernel inside this
        # container on an AMX CPU (docs/images.md); float32 runs everywhere.
        "--dtype",
        "float32",
    ]
    env = {
        POLICY_ENV: "arc",
        "VLLM_API_KEY": api_key,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PROMETHEUS_MULTIPROC_DIR": METRICS_DIR,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    work = tmp_path_factory.mktemp("image-vllm")
    # The metrics folder the operator's pods get as an emptyDir, writable by the image's user.
    metrics = work / "prometheus"
    metrics.mkdir(mode=0o777)
    metrics.chmod(0o777)
    log = work / "container.log"
    with Container(
        reference,
        args=args,
        env=env,
        binds=[Bind(models, "/models"), Bind(metrics, METRICS_DIR, writable=True)],
        log_path=log,
    ) as container:
        container.start()
        base_url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert container.running(), f"the container exited:\n{container.log()[-4000:]}"
            try:
                return fetch(f"{base_url}/health")[0] == 200
            except OSError:
                return False

        wait_until("the vllm-cpu container's /health", healthy, 600, container.log)
        yield Serving(container, base_url, api_key)


@pytest.mark.vllm
def test_vllm_cpu_image_serves_a_completion_with_the_arc_policy(serving: Serving) -> None:
    assert serving.container.uid == 10001
    assert fetch(f"{serving.base_url}/v1/models")[0] == 401, "the key guards /v1"
    status, body = fetch(
        f"{serving.base_url}/v1/completions",
        headers=serving.headers,
        body={"model": "/models/tiny-llama", "prompt": "the cache keeps", "max_tokens": 4},
    )
    assert status == 200, f"{body}\n{serving.container.log()[-4000:]}"
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    status, metrics = fetch(f"{serving.base_url}/metrics")
    assert status == 200
    assert 'arc_evictor_policy_info{policy="arc"} 1.0' in metrics


@pytest.mark.vllm
def test_vllm_cpu_image_says_where_its_torch_came_from(built_image: Callable[[str], str]) -> None:
    probe = "import json, torch; print(json.dumps(torch.__version__))"
    with Container(
        built_image("vllm-cpu"), entrypoint=["python3", "-c", probe], args=[]
    ) as container:
        ran = container.run(timeout=300)
        assert container.config is not None
        source = container.config.labels["org.arc-serving.torch-source"]
    assert ran.returncode == 0, ran.stdout
    version = json.loads(ran.stdout.strip().splitlines()[-1])
    # PyPI's torch 2.13.0 is its CUDA build, which reports its CUDA version as a local label.
    expected = {"cpu-index": "2.13.0+cpu", "pypi": "2.13.0+cu"}
    assert version.startswith(expected[source]), (source, version)


@pytest.mark.vllm
@pytest.mark.locust
def test_loadtest_image_replays_a_trace_against_the_vllm_cpu_image(
    built_image: Callable[[str], str], serving: Serving, tmp_path: Path
) -> None:
    records = [
        {
            "timestamp": 0.2 * n,
            "input_length": 64 - 7,
            "output_length": 2,
            "hash_ids": [1, 2 + n % 2],
        }
        for n in range(6)
    ]
    work = tmp_path / "replay"
    work.mkdir()
    (work / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    work.chmod(0o777)  # the container's user writes its results here
    args = [
        "--headless",
        "--only-summary",
        "--host",
        serving.base_url,
        "--trace",
        "/work/trace.jsonl",
        "--trace-format",
        "mooncake",
        "--block-tokens",
        "32",
        "--results",
        "/work/results.jsonl",
        "--summary",
        "/work/summary.json",
        "--run-time",
        "120s",
    ]
    env = {"LOADTEST_API_KEY": serving.headers["Authorization"].removeprefix("Bearer ")}
    binds = [Bind(work, "/work", writable=True)]
    with Container(built_image("loadtest"), args=args, env=env, binds=binds) as container:
        ran = container.run(timeout=300)
    assert ran.returncode == 0, ran.stdout
    summary = json.loads((work / "summary.json").read_text())
    assert summary["requests_ok"] == len(records), summary
    assert summary["requests_failed"] == 0
