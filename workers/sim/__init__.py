"""Simulation of the engine at scale: a step-time model calibrated on measured H200 runs, hardware profiles,
a model-free engine that schedules like the real one and sleeps (or advances a virtual clock) per step, and an
instant engine (instant_engine.py) that emits deterministic tokens at once, for measuring the router alone."""
