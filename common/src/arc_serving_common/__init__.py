"""What arc-serving's products share: trace formats, policy names and metric names.

Pure Python with no dependencies, so the vLLM plugin, the simulator, the load test and the
operator can each depend on it without depending on one another.
"""

__version__ = "0.1.0"
