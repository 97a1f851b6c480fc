"""A local Kubernetes 1.35 control plane for tests/cluster: kwokctl's binary runtime running
etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the kwok controller, all built
from the Go module proxy into .tools/bin (`make cluster-binaries`), with three fake kwok nodes
and one real node (cluster/node.py: kubelet, kube-proxy, Debian's containerd, runc and CNI
plugins), in a loopback-only network namespace of its own (cluster/netns.py).

`python -m cluster up|down|status|shell|import-images --out out/cluster` (cluster/local.py,
LocalCluster);
`python -m cluster.netns -- COMMAND` runs a command in a namespace of its own (every test run);
cluster/README.md has the details."""
