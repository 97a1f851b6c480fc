"""Records every file-system write a Python process makes (test helper, never shipped).

Put this directory on PYTHONPATH and set ARC_WRITE_AUDIT_LOG to a file: every Python process
started with that environment (vLLM's API server, its engine core, their helpers) appends one
line ``event<TAB>absolute path`` per write it attempts, through a PEP 578 audit hook. Writes made
from C code without a Python call (torch kernels, ZeroMQ sockets) are not seen.
"""

from __future__ import annotations

import os
import sys
import threading

_LOG = os.environ.get("ARC_WRITE_AUDIT_LOG")
# os.open's flags that make an open a write.
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Events that create, change or remove a path: (path argument, its dir_fd argument) pairs.
# shutil.rmtree, for one, removes relative names inside a directory descriptor.
_PATH_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.symlink": ((1, 2),),
    "os.link": ((1, 3),),
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
}
_busy = threading.local()


def _is_write(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return any(char in mode for char in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _record(fd: int, event: str, path: object, dir_fd: object = None) -> None:
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):  # a file descriptor: already opened, and recorded then
        return
    # CPython passes -1 for "no dir_fd".
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    line = f"{event}\t{os.path.abspath(path)}\n"
    os.write(fd, line.encode("utf-8", "backslashreplace"))


def _install(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def hook(event: str, args: tuple[object, ...]) -> None:
        if getattr(_busy, "on", False):
            return
        _busy.on = True
        try:
            if event == "open" and len(args) == 3 and _is_write(args[1], args[2]):
                _record(fd, event, args[0])
            elif event in _PATH_EVENTS:
                for path_index, fd_index in _PATH_EVENTS[event]:
                    dir_fd = args[fd_index] if fd_index is not None else None
                    _record(fd, event, args[path_index], dir_fd)
        finally:
            _busy.on = False

    sys.addaudithook(hook)


if _LOG:
    _install(_LOG)
