"""`python -m cluster up|down|status|shell [--out out/cluster]`: the local control plane, in a
loopback-only network namespace of its own (cluster/netns.py).

`up` makes the namespace (or finds it) and starts the cluster inside it; `shell` runs a shell,
or the command after `--`, inside it with KUBECONFIG set and .tools/bin first on PATH; `down`
stops the cluster and every process of the namespace, and the namespace with them. `--here`
works on a cluster in this process's own network namespace instead (tests/cluster's case: the
test run has a loopback-only namespace of its own).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from cluster.local import CLUSTER_NAME, ClusterError, LocalCluster
from cluster.netns import NamespaceError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster",
        usage="%(prog)s [-h] [--out OUT] [--name NAME] [--timeout TIMEOUT] [--here] "
        "{up,down,status,shell} [-- COMMAND [ARG...]]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "down", "status", "shell"])
    parser.add_argument("--out", type=Path, default=Path("out/cluster"))
    parser.add_argument("--name", default=CLUSTER_NAME, help="kwokctl's cluster name")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for up/down")
    parser.add_argument(
        "--here",
        action="store_true",
        help="the cluster in this process's network namespace, not in the held one",
    )
    argv = sys.argv[1:] if argv is None else argv
    # shell's command follows `--`, its options left to it.
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if command and args.command != "shell":
        parser.error(f"only shell takes a command after --, not {args.command}")
    cluster = LocalCluster(out=args.out, name=args.name)
    try:
        if args.here or cluster.namespace.inside():
            return here(cluster, args.command, args.timeout)
        return held(cluster, args.command, args.timeout, command)
    except (ClusterError, NamespaceError) as error:
        print(f"python -m cluster {args.command}: {error}", file=sys.stderr)
        return 1


def here(cluster: LocalCluster, command: str, timeout: float) -> int:
    """up, down or status of the cluster in this process's network namespace."""
    start = time.monotonic()
    if command == "up":
        started = cluster.up(timeout=timeout)
        verb = "started" if started else "already running, reused"
        print(f"cluster {cluster.name} {verb} in {time.monotonic() - start:.1f} s")
    elif command == "down":
        cluster.down(timeout=timeout)
        print(f"cluster {cluster.name} stopped in {time.monotonic() - start:.1f} s")
    elif command == "status":
        running = cluster.answering()
        print(f"cluster {cluster.name}: {'answering' if running else 'not answering'}")
        print(f"processes: {cluster.pids()}")
        return 0 if running else 1
    else:
        raise ClusterError("shell needs the cluster's held namespace; drop --here")
    return 0


def held(cluster: LocalCluster, command: str, timeout: float, argv: list[str]) -> int:
    """The same, run inside the cluster's held namespace; and shell."""
    namespace = cluster.namespace
    inside = [sys.executable, "-m", "cluster", "--out", str(cluster.out.resolve())]
    inside += ["--name", cluster.name, "--timeout", str(timeout), "--here"]
    if command == "up":
        made = namespace.holder() is None
        pid, _ = namespace.start()
        code = namespace.run_inside([*inside, "up"])
        if code != 0:
            print("make cluster-down (python -m cluster down) stops what it left", file=sys.stderr)
            return code
        print(
            f"in network namespace of holder {pid} ({'made' if made else 'reused'}; loopback "
            f"only, no route out)\nreach it: make cluster-shell (a shell) or "
            f"make cluster-shell -- kubectl get nodes; KUBECONFIG={cluster.kubeconfig}"
        )
        return 0
    if namespace.holder() is None:
        if command == "down":
            # A cluster started in this namespace before it had a namespace of its own.
            return here(cluster, "down", timeout)
        raise ClusterError(f"no cluster namespace under {cluster.out} (make cluster)")
    if command == "shell":
        env = {**cluster.client_env(), "PATH": f"{cluster.bin_dir}{os.pathsep}{os.environ['PATH']}"}
        shell = argv or [os.environ.get("SHELL") or "/bin/bash"]
        os.execvpe(namespace.enter()[0], [*namespace.enter(), *shell], env)
    if command == "down":
        start = time.monotonic()
        namespace.run_inside([*inside, "down"])
        namespace.stop(timeout=timeout)
        print(
            f"cluster {cluster.name} and its network namespace stopped in "
            f"{time.monotonic() - start:.1f} s; no process left"
        )
        return 0
    return namespace.run_inside([*inside, "status"])


if __name__ == "__main__":
    sys.exit(main())
