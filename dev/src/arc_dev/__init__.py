"""arc-serving's development harness, never shipped: demo, vLLM server, tiny model, benches."""
