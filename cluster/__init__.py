"""A local Kubernetes 1.35 control plane for tests/cluster: kwokctl's binary runtime running
etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kwok controller, all built
from the Go module proxy into .tools/bin (`make cluster-binaries`), with three fake kwok nodes.

`python -m cluster up|down|status --out out/cluster`; cluster/README.md has the details."""

from cluster.local import (
    CLUSTER_NAME,
    NODE_NAMES,
    ClusterError,
    LocalCluster,
)

__all__ = ["CLUSTER_NAME", "NODE_NAMES", "ClusterError", "LocalCluster"]
