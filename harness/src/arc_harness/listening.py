"""The TCP sockets a process tree listens on, read from ``/proc`` (Linux).

Tests use ``ListenerSampler`` to check that what they start (vLLM servers, the router,
Prometheus, Locust) listens on loopback addresses only: it samples, on a thread, every
listening socket of the calling process's descendants while they run. A socket is found by its
inode: ``/proc/PID/fd`` links to ``socket:[INODE]``, and ``/proc/PID/net/tcp`` and ``tcp6``
(the process's own network namespace) give the local address of each socket in state LISTEN.
Processes and sockets that vanish between two reads are skipped: a sample is what could be
read at that moment.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

PROC = Path("/proc")
TCP_LISTEN = "0A"  # the kernel's TCP_LISTEN state, as /proc/net/tcp prints it
SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket of one process."""

    pid: int
    command: str  # the process's command line, arguments joined by spaces
    address: Address
    port: int

    @property
    def is_loopback(self) -> bool:
        """Bound to a loopback address (127.0.0.0/8, ::1, or an IPv4-mapped 127.x.y.z)."""
        address = self.address
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    def describe(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port} (pid {self.pid}: {self.command[:120]})"


def parse_proc_address(text: str) -> tuple[Address, int]:
    """A ``/proc/net/tcp{,6}`` address ``HEX:PORT``: the address is 32-bit words in host byte
    order (little-endian on every platform vLLM's CPU build runs on), the port big-endian hex."""
    hex_address, hex_port = text.split(":")
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.IPv4Address(words) if len(words) == 4 else ipaddress.IPv6Address(words)
    return address, int(hex_port, 16)


def listening_inodes(net_dir: Path) -> dict[int, tuple[Address, int]]:
    """Inode -> (address, port) of every TCP socket in state LISTEN in ``net_dir``'s tables."""
    found: dict[int, tuple[Address, int]] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (net_dir / table).read_text().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel, or the process has gone
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == TCP_LISTEN:
                found[int(fields[9])] = parse_proc_address(fields[1])
    return found


def descendants(root: int) -> list[int]:
    """Every live descendant of process ``root``, found through each of its threads'
    ``children`` file (a child is listed under the thread that forked it)."""
    found: list[int] = []
    pending = [root]
    while pending:
        pid = pending.pop()
        for children in PROC.glob(f"{pid}/task/*/children"):
            try:
                kids = [int(child) for child in children.read_text().split()]
            except OSError:
                continue
            found.extend(kids)
            pending.extend(kids)
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open (empty if it has gone)."""
    inodes = set()
    try:
        descriptors = list((PROC / str(pid) / "fd").iterdir())
    except OSError:
        return inodes
    for descriptor in descriptors:
        try:
            match = SOCKET_LINK.fullmatch(os.readlink(descriptor))
        except OSError:
            continue
        if match:
            inodes.add(int(match.group(1)))
    return inodes


def command_line(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def sample_listeners(root: int | None = None) -> set[Listener]:
    """Every TCP socket that a descendant of ``root`` (default: this process) listens on now."""
    tables: dict[str, dict[int, tuple[Address, int]]] = {}
    found = set()
    for pid in descendants(os.getpid() if root is None else root):
        inodes = socket_inodes(pid)
        if not inodes:
            continue
        try:  # one read of the tables per network namespace
            namespace = os.readlink(PROC / str(pid) / "ns" / "net")
        except OSError:
            continue
        if namespace not in tables:
            tables[namespace] = listening_inodes(PROC / str(pid) / "net")
        listening = tables[namespace]
        for inode in inodes & listening.keys():
            address, port = listening[inode]
            found.add(Listener(pid, command_line(pid), address, port))
    return found


class ListenerSampler:
    """Samples ``sample_listeners`` on entering its ``with`` block and then every
    ``interval_s`` on a thread until its end; ``listeners`` holds every listener seen."""

    def __init__(self, interval_s: float = 0.5, root: int | None = None) -> None:
        self.interval_s = interval_s
        self.root = root
        self.listeners: set[Listener] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="listener-sampler", daemon=True)

    def sample(self) -> set[Listener]:
        """One sample now, added to ``listeners``; returns it."""
        found = sample_listeners(self.root)
        self.listeners |= found
        self.samples += 1
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> ListenerSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def exposed(self) -> list[Listener]:
        """Every listener seen on an address other than loopback, sorted by port."""
        return sorted((item for item in self.listeners if not item.is_loopback),
                      key=lambda item: (item.port, item.pid))  # fmt: skip
