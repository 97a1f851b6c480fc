"""arc-serving's demos and benchmarks, never shipped: demo, fleet demo, pacing, snapshot, bench."""
