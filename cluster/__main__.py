"""`python -m cluster up|down|status|shell [--out out/cluster]`: the local control plane and its
real node, in a loopback-only network namespace of its own (cluster/netns.py).

`up` makes the namespace (or finds it) and starts the cluster inside it, with its real node
(cluster/node.py) unless `--no-real-node` (which stops a running one); `shell` runs a shell,
or the command after `--`, inside it with KUBECONFIG set and .tools/bin first on PATH;
`import-images` copies images from buildah's storage into the real node's containerd (those
after `--`, else every image out/images/built.json lists: `make images-local`); `addons` runs
cluster DNS and the ingress controller on the real node (cluster/addons.py); `down`
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

from cluster import addons
from cluster.images import BUILT_IMAGES, built_images
from cluster.local import CLUSTER_NAME, ClusterError, LocalCluster
from cluster.netns import NamespaceError
from cluster.node import NodeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster",
        usage="%(prog)s [-h] [--out OUT] [--name NAME] [--timeout TIMEOUT] [--here] "
        "[--no-real-node] {up,down,status,shell,import-images,addons} "
        "[-- COMMAND [ARG...] | REF...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command", choices=["up", "down", "status", "shell", "import-images", "addons"]
    )
    parser.add_argument("--out", type=Path, default=Path("out/cluster"))
    parser.add_argument("--name", default=CLUSTER_NAME, help="kwokctl's cluster name")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for up/down")
    parser.add_argument(
        "--here",
        action="store_true",
        help="the cluster in this process's network namespace, not in the held one",
    )
    parser.add_argument(
        "--no-real-node",
        dest="real_node",
        action="store_false",
        help="up: kwok's nodes only (a running real node is stopped)",
    )
    argv = sys.argv[1:] if argv is None else argv
    # shell's command (its options left to it) and import-images' references follow `--`.
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if command and args.command not in ("shell", "import-images"):
        parser.error(f"only shell and import-images take arguments after --, not {args.command}")
    cluster = LocalCluster(out=args.out, name=args.name, real_node=args.real_node)
    try:
        if args.here or cluster.namespace.inside():
            return here(cluster, args.command, args.timeout, command)
        return held(cluster, args.command, args.timeout, command)
    except (ClusterError, NamespaceError) as error:
        print(f"python -m cluster {args.command}: {error}", file=sys.stderr)
        return 1


def every_built_reference() -> list[str]:
    """Every image `make images-local` (dev/build_images.py) recorded."""
    built = built_images()
    if not built:
        raise ClusterError(f"no {BUILT_IMAGES}: run make images-local, or name images")
    return [str(image["reference"]) for image in built.values()]


def here(cluster: LocalCluster, command: str, timeout: float, references: list[str]) -> int:
    """up, down, status or import-images of the cluster in this process's network
    namespace."""
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
        stopped = cluster.stopped_components()
        if running and stopped:
            print(f"not running: {', '.join(stopped)} (logs in {cluster.cluster_dir}/logs)")
        node = cluster.real_node
        state = "Ready" if node.ready() else "running" if node.running() else "not running"
        print(f"real node {node.name}: {state}; processes: {node.processes()}")
        return 0 if running else 1
    elif command == "import-images":
        try:
            imported = cluster.real_node.import_images(references or every_built_reference())
        except NodeError as error:
            raise ClusterError(str(error)) from error
        for reference, seconds in imported.items():
            done = "already there" if seconds is None else f"imported in {seconds:.1f} s"
            print(f"{reference}: {done}")
    elif command == "addons":
        try:
            installed = addons.install(cluster)
        except NodeError as error:
            raise ClusterError(str(error)) from error
        print(
            f"cluster DNS at {installed.dns_address}; the ingress controller (IngressClass and "
            f"GatewayClass traefik, Gateway traefik/traefik listener web) at "
            f"{installed.ingress_url}"
        )
    else:
        raise ClusterError("shell needs the cluster's held namespace; drop --here")
    return 0


def held(cluster: LocalCluster, command: str, timeout: float, argv: list[str]) -> int:
    """The same, run inside the cluster's held namespace; and shell."""
    namespace = cluster.namespace
    inside = [sys.executable, "-m", "cluster", "--out", str(cluster.out.resolve())]
    inside += ["--name", cluster.name, "--timeout", str(timeout), "--here"]
    inside += [] if cluster.with_real_node else ["--no-real-node"]
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
        code = namespace.run_inside([*inside, "down"])
        namespace.stop(timeout=timeout)
        if code != 0:
            # The real node's pods run in network namespaces of their own: say so, not "none".
            print(f"its network namespace is stopped, but down failed ({code})", file=sys.stderr)
            return code
        print(
            f"cluster {cluster.name} and its network namespace stopped in "
            f"{time.monotonic() - start:.1f} s; no process left"
        )
        return 0
    if command == "import-images":
        return namespace.run_inside([*inside, "import-images", "--", *argv])
    if command == "addons":
        return namespace.run_inside([*inside, "addons"])
    return namespace.run_inside([*inside, "status"])


if __name__ == "__main__":
    sys.exit(main())
