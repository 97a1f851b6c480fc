"""Loopback-only network namespaces: where the local cluster and every test process run.

Such a namespace has the loopback interface and no other: no default route, so a connection to
any address off this machine (private ranges included) fails at once with ENETUNREACH. Two
ranges reserved for network benchmarks (RFC 2544, 198.18.0.0/15) are local inside it: kwok's
simulated pods take their addresses from ``SIMULATED_POD_RANGE`` and Services theirs from
``SERVICE_RANGE``, so a scrape of a simulated pod reaches this namespace's own loopback (refused
unless a test listens there) and never leaves it. The local cluster's real node (cluster/node.py)
adds ``NODE_ADDRESS`` to ``lo`` and a bridge whose pods take ``REAL_POD_RANGE``, a /24 of the
same benchmark range outside the simulated one, so it too stays inside the namespace.

A holder process owns the namespace: ``unshare --net sleep infinity`` as root, or
``unshare --user --map-root-user --net sleep infinity`` where user namespaces are allowed.
Everything else enters it with ``nsenter --target HOLDER``. Stopping kills every process whose
network namespace is the holder's, found by the namespace's inode in /proc (never by name),
then the holder; the namespace goes with its last process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SIMULATED_POD_RANGE = "198.18.0.0/17"
SERVICE_RANGE = "198.19.0.0/16"
LOCAL_RANGES = (SIMULATED_POD_RANGE, SERVICE_RANGE)
# The real node's pods, on its bridge: routed to the bridge, not local like the simulated range.
REAL_POD_RANGE = "198.18.128.0/24"
# The real node's address, on lo (RFC 5737's TEST-NET-2): what the API server advertises, so
# that pods reach it through the `kubernetes` Service, and where the kubelet listens.
NODE_ADDRESS = "198.51.100.10"
# The processes that run without root: the holder gets a user namespace where this user is root.
USERNS = os.geteuid() != 0


# The holders this process started, by pid: kept until `stop` reaps them (a Popen collected
# while its process runs warns).
_STARTED: dict[int, subprocess.Popen[bytes]] = {}


class NamespaceError(RuntimeError):
    """A network namespace could not be made, entered or emptied."""


def netns_inode(pid: int | str = "self") -> int | None:
    """The inode of a process's network namespace; None when it is gone or not ours to read."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def processes_in(inode: int) -> list[int]:
    """Every process whose network namespace has this inode, but this one."""
    found = []
    for entry in Path("/proc").iterdir():
        if (
            entry.name.isdigit()
            and int(entry.name) != os.getpid()
            and netns_inode(entry.name) == inode
        ):
            found.append(int(entry.name))
    return sorted(found)


def _check_tools() -> None:
    """unshare and nsenter (util-linux) and ip (iproute2), and the right to make a namespace."""
    import shutil

    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        raise NamespaceError(
            f"{', '.join(missing)} not found: install util-linux and iproute2 "
            "(apt-get install util-linux iproute2)"
        )
    if USERNS:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--net", "true"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            raise NamespaceError(
                "cannot make a network namespace: not root, and this kernel refuses an "
                f"unprivileged user namespace ({probe.stderr.strip()}); run as root, or allow "
                "user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                "user.max_user_namespaces > 0)"
            )


@dataclass(frozen=True)
class HeldNamespace:
    """A loopback-only network namespace kept alive by a holder process.

    Invariant: while ``pid_file`` names a live holder (its pid and the inode of its network
    namespace, both checked), that namespace has ``lo`` up, the local routes of
    ``LOCAL_RANGES`` and no other route; every process that must be stopped with it is found by
    that inode.
    """

    pid_file: Path

    def holder(self) -> tuple[int, int] | None:
        """(pid, namespace inode) of the live holder, or None (no file, or a stale one)."""
        try:
            pid_text, inode_text = self.pid_file.read_text().split()
            pid, inode = int(pid_text), int(inode_text)
        except (OSError, ValueError):
            return None
        return (pid, inode) if netns_inode(pid) == inode else None

    def start(self) -> tuple[int, int]:
        """Make the namespace (or find the live one) and return its holder."""
        held = self.holder()
        if held is not None:
            return held
        _check_tools()
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        unshare = ["unshare", *(["--user", "--map-root-user"] if USERNS else []), "--net"]
        holder = subprocess.Popen(
            [*unshare, "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in the caller's terminal leaves it to `stop`
        )
        ours = netns_inode()
        deadline = time.monotonic() + 10
        while (inode := netns_inode(holder.pid)) in (None, ours):
            if holder.poll() is not None or time.monotonic() > deadline:
                holder.kill()
                _, error = holder.communicate()
                raise NamespaceError(
                    f"unshare did not make a network namespace ({' '.join(unshare)}): "
                    f"{error.decode().strip() or 'no new namespace after 10 s'}"
                )
            time.sleep(0.01)
        assert inode is not None and holder.stderr is not None
        holder.stderr.close()
        _STARTED[holder.pid] = holder
        self.pid_file.write_text(f"{holder.pid} {inode}\n")
        try:
            for command in (
                ["ip", "link", "set", "lo", "up"],
                *(["ip", "route", "add", "local", cidr, "dev", "lo"] for cidr in LOCAL_RANGES),
            ):
                self.run(command, check=True, capture_output=True)
        except subprocess.CalledProcessError as error:
            self.stop()
            raise NamespaceError(f"{' '.join(error.cmd)} failed: {error.stderr}") from error
        return holder.pid, inode

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace."""
        held = self.holder()
        if held is None:
            raise NamespaceError(f"no namespace holder is alive ({self.pid_file})")
        user = ["--user", "--preserve-credentials"] if USERNS else []
        return ["nsenter", f"--target={held[0]}", *user, "--net", "--"]

    def run(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*self.enter(), *argv], env=env, **kwargs)  # type: ignore[call-overload, no-any-return]

    def inside(self) -> bool:
        """This process runs in the namespace."""
        held = self.holder()
        return held is not None and netns_inode() == held[1]

    def run_inside(self, argv: Sequence[str], keep: bool = True) -> int:
        """Run a command inside the namespace, made here if there is none, and return its exit
        code; a namespace made here is stopped afterwards unless ``keep``."""
        made = self.holder() is None
        self.start()
        try:
            return subprocess.run([*self.enter(), *argv], check=False).returncode
        finally:
            if made and not keep:
                self.stop()

    def processes(self) -> list[int]:
        """The processes inside the namespace, the holder included."""
        held = self.holder()
        return processes_in(held[1]) if held else []

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM every process inside, SIGKILL what is left after the grace period, then the
        holder; fail naming any process that survives."""
        held = self.holder()
        if held is None:
            self.pid_file.unlink(missing_ok=True)
            return
        pid, inode = held
        deadline = time.monotonic() + timeout
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for victim in processes_in(inode):
                if victim != pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, sig)
            grace = min(deadline, time.monotonic() + 10)
            while set(processes_in(inode)) - {pid} and time.monotonic() < grace:
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if pid in _STARTED:
            _STARTED.pop(pid).wait()
        while processes_in(inode) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = processes_in(inode)
        if left:
            raise NamespaceError(f"processes left in the namespace after stopping it: {left}")
        self.pid_file.unlink(missing_ok=True)


def run_isolated(argv: Sequence[str], pid_file: Path) -> int:
    """Run a command in a new loopback-only namespace, wait for it, then stop everything it
    left running there (a server a crashed test did not stop, a cluster's daemons)."""
    return HeldNamespace(pid_file).run_inside(argv, keep=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.netns",
        description="Run a command in a new loopback-only network namespace (no route off "
        "this machine), then stop every process it left there.",
    )
    parser.add_argument(
        "--pid-file",
        type=Path,
        help="where the namespace's holder is recorded (default: a file in out/netns/)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python -m cluster.netns -- COMMAND [ARG...]")
    pid_file = args.pid_file or Path("out/netns") / f"{os.getpid()}.pid"
    try:
        return run_isolated(command, pid_file)
    except NamespaceError as error:
        print(f"python -m cluster.netns: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
