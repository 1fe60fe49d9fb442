"""The Qwen3-VL vision tower on one device: transformers' module (SDPA) beside our forward over the same random
weights, in one run; prints one JSON object (ms per image, medians; our outputs' error relative to transformers').

Workloads: batches of equal square images, e.g. 16 x 1,024 patches (512x512 px) and 4 x 4,096 (1024x1024 px). On
CUDA also our tower with the fc1 + GELU cuBLASLt epilogue. Errors are relative Frobenius norms, the largest over the
main embeddings and the DeepStack features. `--shape tiny` is a CPU smoke mode with tiny dims.
`--new-shapes N`: our tower on N image shapes it has not seen, attention on cuDNN and then on flash: the first call
(any per-shape set-up included: cuDNN builds an attention plan per shape) beside the second.
`--batch-sweep 1,2,4,...`: our tower on that many equal catalogue images (64 x 64 patches) per call: ms per image
by batch size (the engine encodes the images of a step's new prompts in one call).
`--head-dim-sweep`: attention alone (SDPA's default backend) on ten catalogue images at head_dim 64-128, timed
against the tower's own head_dim: what padding the heads would cost or save.
`--fp8-linears`: also our tower with the blocks' linears in FP8 (EngineConfig.vision_precision fp8).
Usage: python -m scripts.bench_vision [--shape 30b-a3b|235b-a22b|tiny] [--reps N] [--new-shapes N]
                                      [--batch-sweep B,...] [--head-dim-sweep] [--fp8-linears] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab.bench.gpu_timing import time_us
from workers.model import vision_kernels
from workers.model.vision import VisionTower, build_vision_module
from workers.tiny_checkpoint import TINY_OVERRIDES, released_config, transformers_config
from workers.weights import init_random_weights

PRESETS = {"30b-a3b": "qwen3-vl-30b-a3b", "235b-a22b": "qwen3-vl-235b-a22b", "tiny": "qwen3-vl-30b-a3b"}
WORKLOADS = {"tiny": [(4, 4), (2, 8)], "real": [(16, 32), (4, 64)]}  # (images, grid side in patches)


def median_ms(fn, reps: int, cuda: bool) -> float:
    """Median over reps of one call's time: CUDA events around 3 calls (after a warm-up), or the wall clock."""
    if cuda:
        return statistics.median(time_us(fn, iters=3) for _ in range(reps)) / 1e3
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def preset_vision_config(shape: str):
    """transformers' vision config of a --shape preset (tiny: the tiny checkpoint's dims)."""
    overrides = dict(TINY_OVERRIDES["moe"]) if shape == "tiny" else {}
    return transformers_config(released_config(PRESETS[shape], overrides)).vision_config


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want))


def bench_workload(module, exact, towers: dict, images: int, side: int, reps: int, device: str) -> dict:
    """Times per image; errors of the bf16 outputs against transformers' bf16 module and against `exact` (the same
    weights run in float32)."""
    cuda = device.startswith("cuda")
    in_features = module.patch_embed.proj.weight[0].numel()
    grid = torch.tensor([[1, side, side]] * images)
    pixels = torch.randn(images * side * side, in_features, device=device).to(module.pos_embed.weight.dtype)
    grid_on_device = grid.to(device)

    def transformers_call(m=module, x=pixels):
        out = m(x, grid_thw=grid_on_device, return_dict=True)
        return [out.pooler_output, *out.deepstack_features]

    result = {"images": images, "patches_per_image": side * side}
    reference, truth = transformers_call(), transformers_call(exact, pixels.float())
    result["transformers_ms_per_image"] = round(median_ms(transformers_call, reps, cuda) / images, 3)
    result["transformers_error_vs_fp32"] = float(f"{relative_error(reference, truth):.3g}")
    for name, tower in towers.items():
        embeds, features = tower(pixels, grid)
        result[f"{name}_ms_per_image"] = round(median_ms(lambda: tower(pixels, grid), reps, cuda) / images, 3)
        result[f"{name}_error_vs_transformers"] = float(f"{relative_error([embeds, *features], reference):.3g}")
        result[f"{name}_error_vs_fp32"] = float(f"{relative_error([embeds, *features], truth):.3g}")
    result["speedup"] = round(result["transformers_ms_per_image"] / result["ours_ms_per_image"], 2)
    return result


ATTENTION_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def new_shapes(count: int, max_side: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """`count` distinct (images, h, w): a batch of 1 to 4 equal images of h x w patches, h and w even; the fixed
    catalogue's 1024x1024 image (64 x 64 patches) alone and four at once come first."""
    rng = np.random.default_rng(seed)
    shapes = [(1, 64, 64), (4, 64, 64)][:count]
    for _ in range(100 * count):
        if len(shapes) == count:
            return shapes
        shape = (int(rng.integers(1, 5)), *(2 * int(v) for v in rng.integers(8, max_side // 2 + 1, 2)))
        if shape not in shapes:
            shapes.append(shape)
    raise ValueError(f"--new-shapes {count}: sides up to {max_side} give too few distinct shapes")


def bench_new_shapes(tower: VisionTower, in_features: int, dtype, device: str, count: int, max_side: int) -> dict:
    """Our tower on `count` image shapes it has not seen, with attention on cuDNN and then on flash (cuDNN first, so
    its per-shape plans are built here): wall ms of the first call per shape (per-shape set-up included) and of the
    second. The position tables are built beforehand, so only attention's per-shape cost differs between the two."""
    cuda = device.startswith("cuda")
    shapes = new_shapes(count, max_side)

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    inputs = []
    for images, h, w in shapes:
        tower.tables([(1, h, w)])
        inputs.append((torch.randn(images * h * w, in_features, device=device).to(dtype), torch.tensor([[1, h, w]] * images)))
    result: dict = {"shapes": [list(s) for s in shapes]}
    for name, backend in ATTENTION_BACKENDS.items():
        first, second = [], []
        try:
            with sdpa_kernel([backend]):
                for x, grid in inputs:
                    first.append(round(timed(lambda: tower(x, grid)), 2))
                    second.append(round(timed(lambda: tower(x, grid)), 2))
        except RuntimeError as exc:  # no kernel of that backend here (the CPU)
            result[name] = {"error": str(exc)[:300]}
            continue
        result[name] = {"first_ms": first, "second_ms": second,
                        "first_ms_sum": round(sum(first), 1), "second_ms_sum": round(sum(second), 1)}
    return result


def bench_batch_sweep(tower: VisionTower, in_features: int, dtype, device: str, batches: list[int], side: int,
                      reps: int) -> dict:
    """ms per image of our tower on B equal side x side images per call, for each B."""
    cuda = device.startswith("cuda")
    out = {}
    for images in batches:
        grid = torch.tensor([[1, side, side]] * images)
        x = torch.randn(images * side * side, in_features, device=device).to(dtype)
        out[str(images)] = round(median_ms(lambda: tower(x, grid), reps, cuda) / images, 3)
    return {"patches_per_image": side * side, "ms_per_image": out}


HEAD_DIMS = (64, 72, 80, 96, 128)


def bench_head_dims(heads: int, head_dim: int, images: int, side: int, dtype, device: str, reps: int) -> dict:
    """Bidirectional attention over `images` images of side x side patches at each of HEAD_DIMS (SDPA's default
    backend, cuDNN on the H200): ms per call, and TFLOP/s of the work at the tower's own head_dim."""
    cuda = device.startswith("cuda")
    seq = side * side
    useful = 4.0 * images * heads * seq * seq * head_dim
    out = {}
    for d in HEAD_DIMS:
        q, k, v = (torch.randn(images, heads, seq, d, device=device).to(dtype) for _ in range(3))
        ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5), reps, cuda)
        out[str(d)] = {"ms": round(ms, 3), "useful_tflops": float(f"{useful / ms / 1e9:.4g}")}
    return {"images": images, "patches_per_image": seq, "heads": heads, "tower_head_dim": head_dim, "by_head_dim": out}


def main(argv: list[str] | None = None) -> dict:
    """The command line of scripts/bench_vision.py: the figures asked for, printed (and written to --out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(PRESETS), default="30b-a3b")
    p.add_argument("--device", default=None, help="default: cuda, or cpu for --shape tiny")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per figure (median)")
    p.add_argument("--new-shapes", type=int, default=0, help="also first-call vs second-call times on this many "
                   "unseen image shapes per attention backend")
    p.add_argument("--batch-sweep", default=None, help="comma-separated images per call (catalogue-sized images)")
    p.add_argument("--head-dim-sweep", action="store_true", help="attention alone at head_dim 64-128")
    p.add_argument("--fp8-linears", action="store_true", help="also our tower with the blocks' linears in FP8 "
                   "(EngineConfig.vision_precision fp8: e4m3 per output row, per-token activations), on a copy")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_vision: no CUDA device (use --shape tiny for the CPU smoke mode)")
    dtype = torch.bfloat16 if cuda else torch.float32
    vision_config = preset_vision_config(args.shape)
    torch.manual_seed(0)
    module = build_vision_module("moe", vision_config, torch.device(device), dtype)
    init_random_weights(module, seed=0)
    module.eval()
    exact = copy.deepcopy(module).float() if dtype != torch.float32 else module
    towers = {"ours": VisionTower(module)}
    if cuda:
        towers["ours_gelu_epilogue"] = VisionTower(module, gelu_epilogue=True)
    if args.fp8_linears:  # quantising replaces the copy's float weights
        towers["ours_fp8_linears"] = VisionTower(copy.deepcopy(module), gelu_epilogue=cuda, fp8_linears=True)
    result = {
        "bench": "vision_tower",
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m scripts.bench_vision", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "triton": vision_kernels.triton.__version__ if vision_kernels.triton is not None else None,
        "dtype": str(dtype).removeprefix("torch."),
        "config": {k: getattr(vision_config, k) for k in ("depth", "hidden_size", "num_heads", "intermediate_size",
                                                            "out_hidden_size", "deepstack_visual_indexes")},
        "reps": args.reps,
        "workloads": {},
    }
    with torch.inference_mode():
        for images, side in WORKLOADS["tiny" if args.shape == "tiny" else "real"]:
            name = f"{images}x{side * side}"
            result["workloads"][name] = bench_workload(module, exact, towers, images, side, args.reps, device)
        engine_tower = towers.get("ours_gelu_epilogue", towers["ours"])  # the tower the engine runs here
        in_features = module.patch_embed.proj.weight[0].numel()
        if args.new_shapes:
            result["new_shapes"] = bench_new_shapes(engine_tower, in_features, dtype, device, args.new_shapes,
                                                    40 if args.shape == "tiny" else 160)
        side = 8 if args.shape == "tiny" else 64  # the fixed catalogue's 1024x1024 image: 64 x 64 patches
        if args.batch_sweep:
            batches = [int(b) for b in args.batch_sweep.split(",")]
            result["batch_sweep"] = bench_batch_sweep(engine_tower, in_features, dtype, device, batches, side, args.reps)
        if args.head_dim_sweep:
            heads = vision_config.num_heads
            result["head_dim_sweep"] = bench_head_dims(heads, vision_config.hidden_size // heads, 10, side, dtype,
                                                       device, args.reps)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result

