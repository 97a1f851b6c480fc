"""The command line shared by the generators of committed chart files (CRD, RBAC rules)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def write_or_print(prog: str, render: Callable[[], str], argv: list[str] | None = None) -> int:
    """Print ``render()``, or write it to the one path given; 2 and no file on bad arguments
    (an option such as ``--help`` is never taken for a path)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print(f"usage: python -m {prog} [OUTPUT.yaml]", file=sys.stderr)
        return 2
    text = render()
    if args:
        Path(args[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
