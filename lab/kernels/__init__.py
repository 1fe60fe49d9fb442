"""Kernel tuners: tile-config sweeps of the FP8 and fused MoE kernels, and the writers of the tuned tables that
workers/model/fused_moe.py reads."""
