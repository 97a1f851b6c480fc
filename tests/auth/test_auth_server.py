"""The API key on the real vLLM server (CPU build) and the real Locust, tiny local Llama.

One server for the module, started by ``VllmServer`` with its default: a fresh random key
passed in ``VLLM_API_KEY``. vLLM's own middleware guards ``/v1/*`` and a few other prefixes
only; the plugin makes the key guard every path but ``/health`` (probes) and ``/metrics``
(Prometheus; the chart's NetworkPolicies keep both cluster-internal).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

from arc_harness.vllm_server import VllmServer
from arc_loadtest.run import ReplayRun, run_replay
from tests.replay_budget import replay_run_time_s

pytestmark = [pytest.mark.vllm, pytest.mark.locust, pytest.mark.slow]

BLOCK_TOKENS = 32  # vLLM's CPU block size must be a multiple of 32
MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("auth-vllm") / "vllm.log"
    with VllmServer(model_dir, block_size=BLOCK_TOKENS, num_gpu_blocks=64, served_model_name=MODEL,
                    log_path=log) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three short Mooncake requests, 0.2 s apart (two share a prefix block)."""
    records = [
        {"timestamp": 0, "input_length": 70, "output_length": 2, "hash_ids": [1, 2, 3]},
        {"timestamp": 200, "input_length": 70, "output_length": 2, "hash_ids": [1, 4, 5]},
        {"timestamp": 400, "input_length": 40, "output_length": 3, "hash_ids": [6, 7]},
    ]
    path = tmp_path_factory.mktemp("auth-trace") / "trace.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# 40 token ids: vLLM 0.32's CPU attention dies with SIGILL on some AMX hosts when the engine's
# first prompt is 4 tokens long (8 and more work), whatever the plugin does.
PROMPT = list(range(5, 45))


def complete(server: VllmServer, headers: dict[str, str]) -> requests.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    return requests.post(
        f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=120
    )


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-key"),
        pytest.param({"Authorization": "Bearer not-the-key"}, id="wrong-key"),
        pytest.param({"Authorization": "Bearer "}, id="empty-key"),
        pytest.param({"Authorization": "Basic KEY"}, id="wrong-scheme"),
        pytest.param({"Authorization": "KEY"}, id="no-scheme"),
        pytest.param({"X-Api-Key": "KEY"}, id="other-header"),
    ],
)
def test_requests_without_the_right_bearer_key_get_401(
    server: VllmServer, headers: dict[str, str]
) -> None:
    assert server.api_key
    headers = {name: value.replace("KEY", server.api_key) for name, value in headers.items()}
    for response in (
        complete(server, headers),
        requests.get(f"{server.base_url}/v1/models", headers=headers, timeout=30),
    ):
        assert response.status_code == 401
        assert response.json() == {"error": "Unauthorized"}


def test_the_right_key_gets_a_completion(server: VllmServer) -> None:
    response = complete(server, server.auth_headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    # The scheme is case-insensitive (RFC 7235), as vLLM's middleware reads it.
    lower = {"Authorization": f"bearer {server.api_key}"}
    assert complete(server, lower).status_code == 200


def test_health_and_metrics_stay_open_for_probes_and_prometheus(server: VllmServer) -> None:
    assert requests.get(f"{server.base_url}/health", timeout=30).status_code == 200
    metrics = requests.get(f"{server.base_url}/metrics", timeout=30)
    assert metrics.status_code == 200 and "vllm:prefix_cache_queries_total" in metrics.text


# Paths vLLM 0.32's own middleware leaves open that run a model or read its tokenizer: each
# must need the key (POST /invocations is SageMaker's route to completions and chat).
REGRESSIONS = [("POST", path) for path in
               ("/invocations", "/tokenize", "/detokenize", "/pooling", "/score", "/rerank",
                "/classify")]  # fmt: skip
# Routes the OpenAPI schema does not list, plus paths no route serves and near-misses of the
# open paths (the open list is matched exactly).
UNLISTED = [("GET", path) for path in
            ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect", "/no-such-route",
             "/metrics/", "/metrics/x", "/health/", "/healthz", "/v1")]  # fmt: skip


def served_routes(server: VllmServer) -> set[tuple[str, str]]:
    """(method, path) of every route the server's OpenAPI schema lists (read with the key)."""
    response = requests.get(f"{server.base_url}/openapi.json", headers=server.auth_headers,
                            timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
    return {
        (method.upper(), path)
        for path, operations in response.json()["paths"].items()
        for method in operations
        if method.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}
    }


def test_every_route_but_health_and_metrics_answers_401_without_the_key(
    server: VllmServer,
) -> None:
    routes = served_routes(server)
    # The schema lists the routes of this vLLM, not a fixed list: a route a later vLLM adds is
    # checked too. The open two are the only ones that answer without the key.
    assert ("POST", "/invocations") in routes and ("POST", "/tokenize") in routes, routes
    assert len(routes) > 15, routes
    checked = (routes | set(REGRESSIONS) | set(UNLISTED)) - {("GET", "/health"),
                                                              ("GET", "/metrics")}  # fmt: skip
    open_paths = []
    for method, path in sorted(checked):
        url = server.base_url + re.sub(r"\{[^}]*\}", "x", path)  # path parameters: any value
        response = requests.request(method, url, json={}, timeout=30)
        if response.status_code != 401 or response.json() != {"error": "Unauthorized"}:
            open_paths.append(f"{method} {path}: HTTP {response.status_code}")
    assert not open_paths, f"reachable without the API key: {open_paths}"


def test_the_key_opens_the_paths_vllm_left_open(server: VllmServer) -> None:
    body = {"model": MODEL, "prompt": "hello"}
    tokenize = requests.post(f"{server.base_url}/tokenize", json=body, timeout=30,
                             headers=server.auth_headers)  # fmt: skip
    assert tokenize.status_code == 200 and tokenize.json()["tokens"], tokenize.text
    invocation = requests.post(
        f"{server.base_url}/invocations",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1},
        headers=server.auth_headers,
        timeout=120,
    )
    assert invocation.status_code == 200, invocation.text
    assert requests.get(f"{server.base_url}/version", timeout=30,
                        headers=server.auth_headers).status_code == 200  # fmt: skip


def group_processes(pgid: int) -> dict[int, bytes]:
    """Command line of every live process in process group ``pgid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 5 of /proc/PID/stat is the process group; the name (field 2) may hold
            # spaces, so split after its closing parenthesis.
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
    return found


def test_the_key_is_in_no_command_line_of_the_server_processes(server: VllmServer) -> None:
    assert server._proc is not None
    processes = group_processes(server._proc.pid)
    # The API server and its engine core at least; the key reaches them through env only.
    assert len(processes) >= 2, processes
    key = server.api_key.encode()
    for pid, cmdline in processes.items():
        assert key not in cmdline, f"process {pid} shows the API key on its command line"
        assert b"--api-key" not in cmdline
    environ = (Path("/proc") / str(server._proc.pid) / "environ").read_bytes().split(b"\0")
    assert b"VLLM_API_KEY=" + key in environ


def replay(server: VllmServer, trace: Path, out: Path, **options: object) -> ReplayRun:
    return run_replay(server.base_url, trace, out_dir=out,
                      run_time_s=replay_run_time_s(trace, block_tokens=BLOCK_TOKENS),
                      block_tokens=BLOCK_TOKENS, time_scale=1.0, **options)  # fmt: skip


def test_locust_replay_with_the_key_succeeds_and_writes_the_key_nowhere(
    server: VllmServer, trace: Path, tmp_path: Path
) -> None:
    run = replay(server, trace, tmp_path, api_key=server.api_key)
    assert run.exit_code == 0, run.log[-3000:]
    assert run.summary is not None and run.summary["requests_ok"] == 3
    assert run.summary["requests_unauthorized"] == 0
    written = {
        "results": run.results.read_text(),
        "summary": json.dumps(run.summary),
        "locust log": run.log,
    }
    for name, text in written.items():
        assert server.api_key not in text, f"the API key appears in the {name}"


def test_locust_without_a_key_fails_naming_authentication(
    server: VllmServer, trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller's environment must not slip a key in: run_replay drops LOADTEST_API_KEY.
    monkeypatch.setenv("LOADTEST_API_KEY", server.api_key or "")
    run = replay(server, trace, tmp_path)
    assert run.exit_code == 1, run.log[-3000:]
    assert "authentication failed: the server requires an API key" in run.log
    assert run.summary is not None and run.summary["requests_sent"] == 0
    assert "authentication failed" in run.summary["setup_error"]
    assert "LOADTEST_API_KEY" in run.summary["setup_error"]


def test_every_request_with_a_wrong_key_fails_as_unauthorized(
    server: VllmServer, model_dir: Path, trace: Path, tmp_path: Path
) -> None:
    # With the model and tokenizer given, nothing is asked before the replay: each request
    # meets the 401 itself and the summary counts them.
    run = replay(server, trace, tmp_path, api_key="wrong-key", model=MODEL, tokenizer=model_dir)
    assert run.exit_code == 1, run.log[-3000:]
    assert run.summary is not None
    assert run.summary["requests_unauthorized"] == run.summary["requests_failed"] == 3
    assert "authentication failed: 3 requests answered HTTP 401" in run.log
    rows = [json.loads(line) for line in run.results.read_text().splitlines()]
    assert {row["status"] for row in rows} == {401}
    assert all("rejected the API key" in row["error"] for row in rows)
    assert "wrong-key" not in run.results.read_text() + run.log


def helm_test_script(*sets: str) -> str:
    """The chart's `helm test` pod script, rendered by the real helm."""
    helm = REPO / ".tools" / "bin" / "helm"
    if not helm.is_file():
        pytest.fail(f"{helm} is missing: run `make tools`")
    args = [str(helm), "template", "rel", str(REPO / "charts" / "arc-serving"), "-n", "llm",
            "--show-only", "templates/tests/test-connection.yaml",
            "--set", f"servingPolicy.model.name={MODEL}"]  # fmt: skip
    for pair in sets:
        args += ["--set", pair]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)["spec"]["containers"][0]["args"][0]


def with_key_file(script: str, key_file: Path) -> str:
    """The script reading the key from ``key_file`` instead of the pod's Secret mount."""
    mounted = re.search(r"\$\(cat (\S+)\)", script)
    assert mounted, "the helm test script no longer reads the key from a file"
    return script.replace(mounted.group(1), str(key_file))


@pytest.mark.parametrize(("key", "passes"), [("right", True), ("wrong", False), ("none", False)])
def test_the_charts_helm_test_script_sends_the_key_from_the_secret(
    server: VllmServer, tmp_path: Path, key: str, passes: bool
) -> None:
    key_file = tmp_path / "api-key"
    if key != "none":
        key_file.write_text(server.api_key if key == "right" else "not-the-key")
    script = with_key_file(helm_test_script(), key_file)
    script = script.replace("http://rel-arc-serving:8000", server.base_url)
    done = subprocess.run(["sh", "-ec", script], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]}, timeout=60, check=False)  # fmt: skip
    assert (done.returncode == 0) == passes, done.stdout + done.stderr
    assert server.api_key not in done.stdout + done.stderr


class _OpenApi(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server without authentication: every path answers 200."""

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": MODEL}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: pytest captures stderr."""


def test_the_helm_test_script_fails_against_an_open_api(tmp_path: Path) -> None:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OpenApi) as open_api:
        thread = threading.Thread(target=open_api.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{open_api.server_address[1]}"
        key_file = tmp_path / "api-key"
        key_file.write_text("any-key")
        script = with_key_file(helm_test_script(), key_file)
        script = script.replace("http://rel-arc-serving:8000", url)
        done = subprocess.run(["sh", "-ec", script], capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"]}, timeout=60,
                              check=False)  # fmt: skip
        open_api.shutdown()
    assert done.returncode != 0
    assert "/v1/models without the API key answered HTTP 200, not 401" in done.stderr


def test_the_key_never_reaches_the_server_log(server: VllmServer) -> None:
    # Last in the module: every request above (with, without and with wrong keys) is logged.
    complete(server, server.auth_headers)
    assert server.log_path is not None
    log = server.log_path.read_text(errors="replace")
    assert "POST /v1/completions" in log or "/v1/completions" in log
    assert server.api_key not in log
