"""The trace simulator: replays traces through the eviction policies, with Belady's bound.

It models vLLM's block pool (``pool``), reads the trace formats of ``arc_serving_common``,
generates document-QA and conversation traces, and evaluates every policy against Belady.
The ``arc-evictor`` command is its CLI.
"""

from pathlib import Path

__version__ = "0.1.0"

# The public Mooncake sample (Apache-2.0; data/README.md), shipped as package data.
MOONCAKE_SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic.jsonl"
