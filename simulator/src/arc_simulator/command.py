"""What every ``arc-evictor`` command shares: its usage error, its parser, its exit status.

``cli`` adds every command to ``program_parser``'s parser; a command runnable on its own
(``python -m arc_simulator.scaling``) adds itself alone to one, so both report bad input the
same way: one line on stderr naming the problem, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn, TypeAlias

from arc_evictor.policies.base import PolicyError
from arc_serving_common.traces import TraceError
from arc_simulator.routing import RoutingError

# What ``add_subparsers`` returns: each command adds its parser to it.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class UsageError(ValueError):
    """A command-line value that cannot be used."""


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), like every other error here."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def program_parser() -> tuple[Parser, Subcommands]:
    """The ``arc-evictor`` parser and the subparsers action its commands are added to."""
    parser = Parser(
        prog="arc-evictor",
        description="Prefix-cache eviction policies: simulate, generate, evaluate and scale.",
    )
    return parser, parser.add_subparsers(dest="command", required=True)


def writable_folder(path: Path) -> bool:
    """True if ``path``'s folder exists (or can be made) and takes new files.

    Decided without creating anything: the nearest existing ancestor must be a writable
    folder, and ``path`` itself must not be a folder.
    """
    if path.is_dir():
        return False
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK)


def run(args: argparse.Namespace) -> int:
    """Run the command ``args.run`` with ``args``; bad input is exit status 2."""
    try:
        return args.run(args)
    except (UsageError, PolicyError, TraceError, RoutingError) as error:
        print(f"arc-evictor: error: {error}", file=sys.stderr)
        return 2
