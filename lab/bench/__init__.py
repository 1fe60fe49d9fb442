"""Benchmark instruments of the worker's kernels and engine: GPU timing, attention step inputs, probes around
an engine run, the vision tower's bench. The command lines are in scripts/."""
