"""The test run's network namespace (cluster/netns.py, made by the Makefile's test targets):
loopback only, no route off the machine, the simulated pods' and Services' ranges local to it;
and the session guard (tests/conftest.py) that refuses to run anywhere else."""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.netns import LOCAL_RANGES, SERVICE_RANGE, SIMULATED_POD_RANGE, HeldNamespace

REPO = Path(__file__).resolve().parents[2]
# Connection attempts that must fail in far less than this: refused or unreachable at once.
AT_ONCE_S = 1.0


def routes() -> list[dict[str, object]]:
    """Every route of every table, IPv4 and IPv6, as `ip -json` gives them."""
    found = []
    for family in ("-4", "-6"):
        listed = subprocess.run(
            ["ip", "-json", family, "route", "show", "table", "all"],
            capture_output=True,
            text=True,
            check=True,
        )
        found += json.loads(listed.stdout or "[]")
    return found


def off_machine_routes() -> list[dict[str, object]]:
    return [route for route in routes() if route.get("dev") != "lo"]


@pytest.fixture
def isolated() -> None:
    """Only where this namespace has no route off the machine: elsewhere (a person's run on
    the host network) the tests below would open real connections."""
    if off_machine_routes():
        pytest.skip("the run has a route off this machine; these tests connect off it")


def test_every_route_goes_to_loopback_and_none_is_a_default(isolated: None) -> None:
    found = routes()
    assert not [route for route in found if route.get("dst") == "default"]
    assert {route.get("dev") for route in found} == {"lo"}
    local = {route["dst"] for route in found if route.get("type") == "local"}
    assert set(LOCAL_RANGES) <= local


@pytest.mark.parametrize(
    "address",
    [
        ("10.0.0.1", 8000),
        ("192.168.1.1", 80),
        ("172.16.0.1", 443),
        ("192.0.2.1", 80),
        ("2001:db8::1", 80),
    ],
    ids=lambda address: address[0],
)
def test_a_connection_off_the_machine_fails_at_once(
    isolated: None, address: tuple[str, int]
) -> None:
    start = time.monotonic()
    with pytest.raises(OSError) as failed:
        socket.create_connection(address, timeout=10).close()
    assert failed.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH), failed.value
    assert time.monotonic() - start < AT_ONCE_S


@pytest.mark.parametrize("cidr", [SIMULATED_POD_RANGE, SERVICE_RANGE])
def test_a_simulated_address_is_local_refused_at_once_and_can_be_served_on(
    isolated: None, cidr: str
) -> None:
    pod = str(ipaddress.ip_network(cidr)[1025])
    start = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((pod, 8000), timeout=10).close()
    assert time.monotonic() - start < AT_ONCE_S
    with socket.create_server((pod, 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection((pod, port), timeout=10):
            accepted, peer = server.accept()
            accepted.close()
    assert ipaddress.ip_address(peer[0]) in ipaddress.ip_network(cidr)


# A test of this module, run in a session of its own under the suite's conftest.py.
ROUTES_TEST = (
    f"{Path(__file__).relative_to(REPO)}::test_every_route_goes_to_loopback_and_none_is_a_default"
)


def run_guarded_session(namespace: HeldNamespace, **env: str) -> str:
    """A pytest session of ROUTES_TEST inside ``namespace``: its exit code and output."""
    done = namespace.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", ROUTES_TEST],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    return f"rc={done.returncode}\n{done.stdout}{done.stderr}"


def test_the_guard_refuses_a_session_that_has_a_route_off_the_machine(tmp_path: Path) -> None:
    """A namespace of its own with a default route through a veth pair whose both ends are in
    it: a route exists, so the guard refuses, though no packet could leave."""
    namespace = HeldNamespace(tmp_path / "netns.pid")
    namespace.start()
    try:
        for command in (
            ["ip", "link", "add", "guard0", "type", "veth", "peer", "name", "guard1"],
            ["ip", "addr", "add", "203.0.113.2/24", "dev", "guard0"],
            ["ip", "link", "set", "guard0", "up"],
            ["ip", "link", "set", "guard1", "up"],
            ["ip", "route", "add", "default", "via", "203.0.113.1"],
            ["ip", "-6", "route", "add", "default", "dev", "guard0"],
        ):
            namespace.run(command, check=True, capture_output=True)
        refused = run_guarded_session(namespace)
        assert refused.startswith(f"rc={pytest.ExitCode.USAGE_ERROR.value}\n"), refused
        assert "refusing to run: this network namespace has a route to 10.0.0.1" in refused
        assert "ARC_TESTS_HOST_NETWORK=1" in refused
        # On purpose: the session runs, and the test that would connect off the machine skips.
        overridden = run_guarded_session(namespace, ARC_TESTS_HOST_NETWORK="1")
        assert overridden.startswith("rc=0\n") and "1 skipped" in overridden, overridden
    finally:
        namespace.stop()


def test_the_guard_lets_a_loopback_only_session_run(tmp_path: Path) -> None:
    namespace = HeldNamespace(tmp_path / "netns.pid")
    namespace.start()
    try:
        ran = run_guarded_session(namespace)
        assert ran.startswith("rc=0\n") and "1 passed" in ran, ran
    finally:
        namespace.stop()
