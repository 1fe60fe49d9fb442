"""Benches: the engine against transformers, the image path, data-parallel and prefill/decode layouts on several GPUs,
the router (overhead, bursts, its ceiling), the kernels (FP8, attention, the vision tower), and their workloads and
GPU timing. The command lines are in scripts/."""
