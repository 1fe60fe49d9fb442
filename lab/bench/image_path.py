"""JPEG bytes to the vision tower's input, on the host (PIL: libjpeg and PIL's bicubic, the default "pil") beside the
GPU (nvJPEG and resize_bicubic, EngineConfig.image_decode "nvjpeg"), in one run; prints one JSON object.

For each image size: the median ms of each stage (decode + resize to the host's uint8 pixels; then the copy to the
device, the merge-block permutation and normalisation to the tower's rows, synchronised), and how far nvJPEG's pixels
are from PIL's (the largest and mean difference in levels, the share of values that differ), and the device resize
alone on PIL's own decoded pixels against PIL's resize. Then the 235B tower (random weights, bf16) on one catalogue
image decoded both ways: its outputs' relative difference, beside the tower's own bf16 error against float32 on the
PIL pixels (the scale that difference is to be read against).

Images are catalogue-like JPEGs (harness/query_probe.catalogue_jpeg, quality 90).
Usage: python -m scripts.bench_image_path [--sizes 4000x4000,3000x3000,...] [--reps N] [--tower-size WxH] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from contract.vision_geometry import MAX_PIXELS, MIN_PIXELS, smart_resize
from lab.bench.vision import median_ms as wall_median_ms
from lab.peak.query_probe import catalogue_jpeg
from workers.host_copy import to_device
from workers.inputs.device_image import decode_on_device, decode_resized, resize_bicubic
from workers.inputs.image_processing import decode_image, merge_block_patches, normalise_patches, resized_pixels


def median_ms(fn, reps: int) -> float:
    """Median wall time of fn (which synchronises what it timed: host and device stages alike), after a warm-up."""
    return wall_median_ms(fn, reps, cuda=False)


def pixel_difference(got: torch.Tensor, want: torch.Tensor) -> dict:
    d = (got.int() - want.int()).abs()
    return {"max_levels": int(d.max()), "mean_levels": round(d.float().mean().item(), 4),
            "share_differing": round((d > 0).float().mean().item(), 5)}


def tower_rows(pixels: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return normalise_patches(merge_block_patches(to_device(pixels, device)), dtype)


def bench_size(width: int, height: int, reps: int, device: torch.device) -> dict:
    data = catalogue_jpeg(width, height)
    rh, rw = smart_resize(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def pil():
        return resized_pixels(decode_image(data, 1 << 30))

    def nvjpeg():
        return decode_resized(data, rh, rw, device)

    def nvjpeg_on_device():
        out = decode_on_device(data, rh, rw, device)
        torch.cuda.synchronize(device)
        return out

    def to_input(pixels_fn):
        def run():
            rows = tower_rows(pixels_fn(), device, torch.bfloat16)
            torch.cuda.synchronize(device)
            return rows
        return run

    want = pil()
    got = nvjpeg()
    decoded = torch.from_numpy(np.array(decode_image(data, 1 << 30)))  # libjpeg's pixels, not resized
    resized_on_device = resize_bicubic(decoded.to(device), rh, rw)
    return {
        "image": f"{width}x{height}", "resized": f"{rw}x{rh}", "jpeg_bytes": len(data),
        "ms": {"pil": round(median_ms(pil, reps), 2), "nvjpeg_to_host": round(median_ms(nvjpeg, reps), 2),
               "nvjpeg_on_device": round(median_ms(nvjpeg_on_device, reps), 2),
               "pil_to_tower_input": round(median_ms(to_input(pil), reps), 2),
               "nvjpeg_to_tower_input": round(median_ms(to_input(nvjpeg), reps), 2)},
        "nvjpeg_vs_pil": pixel_difference(got, want),
        "device_resize_vs_pil_resize": pixel_difference(resized_on_device.cpu(), want),
    }


def tower_difference(width: int, height: int, device: torch.device) -> dict:
    """The 235B tower's outputs on one image decoded by PIL and by nvJPEG (bf16), beside its bf16 error on PIL's."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lab.bench.vision import relative_error
    from lab.bench.vision_attention import tower_module
    from workers.model.vision import VisionTower

    data = catalogue_jpeg(width, height, seed=1)
    rh, rw = smart_resize(height, width, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    module = tower_module(str(device), torch.bfloat16)
    tower = VisionTower(module, gelu_epilogue=True)
    grid = torch.tensor([[1, rh // 16, rw // 16]])
    pil_pixels = resized_pixels(decode_image(data, 1 << 30))
    outputs = {}
    for name, pixels in (("pil", pil_pixels), ("nvjpeg", decode_resized(data, rh, rw, device))):
        embeds, features = tower(tower_rows(pixels, device, torch.bfloat16), grid)
        outputs[name] = [embeds, *features]
    exact = copy.deepcopy(module).float()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = exact(tower_rows(pil_pixels, device, torch.float32), grid_thw=grid.to(device), return_dict=True)
    want = [ref.pooler_output, *ref.deepstack_features]
    return {"image": f"{width}x{height}", "patches": int(grid[0, 1] * grid[0, 2]),
            "nvjpeg_vs_pil_bf16": relative_error(outputs["nvjpeg"], outputs["pil"]),
            "pil_bf16_vs_fp32": relative_error(outputs["pil"], want),
            "nvjpeg_bf16_vs_pil_fp32": relative_error(outputs["nvjpeg"], want)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4000x4000,3000x3000,2000x1500,1000x1000")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tower-size", default="1000x1000", help="'' for no tower figures")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_image_path: needs CUDA (nvJPEG)")
    import torchvision

    device = torch.device("cuda")
    result: dict = {
        "bench": "image_path", "device": torch.cuda.get_device_name(device), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m scripts.bench_image_path", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__, "torchvision": torchvision.__version__, "reps": args.reps, "sizes": [],
    }
    with torch.inference_mode():
        for size in args.sizes.split(","):
            width, height = map(int, size.split("x"))
            result["sizes"].append(bench_size(width, height, args.reps, device))
            print(json.dumps(result["sizes"][-1]), file=sys.stderr, flush=True)
        if args.tower_size:
            result["tower"] = tower_difference(*map(int, args.tower_size.split("x")), device)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result
