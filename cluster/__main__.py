"""`python -m cluster up|down|status [--out out/cluster]`: the local control plane."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cluster.local import CLUSTER_NAME, ClusterError, LocalCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--out", type=Path, default=Path("out/cluster"))
    parser.add_argument("--name", default=CLUSTER_NAME, help="kwokctl's cluster name")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for up/down")
    args = parser.parse_args(argv)
    cluster = LocalCluster(out=args.out, name=args.name)
    start = time.monotonic()
    try:
        if args.command == "up":
            started = cluster.up(timeout=args.timeout)
            verb = "started" if started else "already running, reused"
            print(
                f"cluster {cluster.name} {verb} in {time.monotonic() - start:.1f} s; "
                f"KUBECONFIG={cluster.kubeconfig}"
            )
        elif args.command == "down":
            cluster.down(timeout=args.timeout)
            print(f"cluster {cluster.name} stopped in {time.monotonic() - start:.1f} s")
        else:
            running = cluster.answering()
            print(f"cluster {cluster.name}: {'answering' if running else 'not answering'}")
            print(f"processes: {cluster.pids()}")
            return 0 if running else 1
    except ClusterError as error:
        print(f"python -m cluster {args.command}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
