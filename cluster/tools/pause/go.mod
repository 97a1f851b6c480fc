module arc-serving/cluster/tools/pause

// The real node's pod sandbox process (cluster/README.md): containerd's sandbox_image is this
// program alone in an image, built here instead of pulled (registry.k8s.io/pause does the same).

go 1.25.0
