"""arc-serving's prefix-cache eviction: policies, block pool model, simulator, vLLM plugin."""

__version__ = "0.1.0"
