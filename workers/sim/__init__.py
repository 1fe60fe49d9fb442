"""Simulation of the engine at scale: a step-time model calibrated on measured H200 runs, hardware profiles,
and a model-free engine that schedules like the real one and sleeps (or advances a virtual clock) per step."""
