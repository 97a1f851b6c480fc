"""arc-serving's harness of real components, never shipped: vLLM server, tiny model, fleet,
Prometheus."""
