"""The vision tower's attention on one device, every implementation side by side in one run; prints one JSON object.

Kernels (16 heads, head_dim 72, bidirectional; the tower's q/k/v memory: q and k [N, heads, 72] contiguous, v a
strided view of the fused qkv), at each --patches count as one frame:
- SDPA through each backend torch has here (cuDNN, flash, memory-efficient);
- our Triton kernel (workers/model/vision_attention.py) at each --configs tile shape, bf16 and FP8 (the FP8 time with
  and without quantising Q/K/V);
- `attention_tflops`: useful work (4 * heads * 72 * N^2) over the median time; `error_vs_fp32`: the relative
  Frobenius error of the first 1,024 query rows against float32 attention over the same inputs.
- the Gluon kernels (sm_90): bf16 at each --gluon-configs, FP8 at each --gluon-fp8-configs (the FP8 time with the
  quantisation; `gluon_fp8_quantize_ms` its share);
- FlashAttention-4 (--flash-attn4; the optional flash-attn-4 package, workers/model/vision_attention_fa4.py);
- `varlen`: one step's mix of images in one call (SDPA: one call per run of equal sizes; ours: one launch).
- `*_queued`: the same calls back to back, timed around the loop (the host queues each call while the one before runs,
  as it does in a tower pass of 27 layers): at small frames a single call's events also time the host's launch work,
  which the tower hides.
- `mixes` (--mixes): a step's images of the realistic catalogue's sizes (each S x S patches; the catalogue's median
  image is 62 x 62), per mix one attention call over all its frames and one tower pass, with each attention.
- `tower` (--tower-side S): the whole 235B tower (random weights) on one S x S-patch image with each attention, ms
  (median), and the outputs' error against transformers' float32 module on --accuracy-side A.
- `tower_shards` (--tower-shards 2,4,8): one rank's part of the tower split n ways (engine.vision_tensor_parallel:
  rank 0's n-th of the heads and MLP, workers/model/vision.py) on the same image, on this one GPU, with the
  all-reduces left out: what each rank of an n-GPU instance computes. all_reduce_mib_per_pass is what its two
  all-reduces a block move (each rank's [patches, hidden] bf16 sums), for the interconnect's share.
Usage: python -m scripts.bench_vision_attention [--patches 4096,16384,35344,62500] [--reps N]
       [--configs M:N:W:S,...] [--fp8-configs ...] [--tower-side 250] [--tower-shards 2,4,8] [--accuracy-side 128]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab.bench.gpu_timing import median_us, time_us
from workers.model import vision_attention as va
from workers.model.vision_attention_fa4 import PACKAGE as FA4_PACKAGE
from workers.model.vision_attention_fa4 import installed as installed_fa4
from workers.model import vision_attention_gluon_fp8 as fp8_gluon
from workers.model.vision_attention_gluon import GluonConfig
from workers.model.vision_attention_gluon_fp8 import GluonFp8Config
from workers.model.vision import VisionTower, build_vision_module
from workers.parallel import TensorParallel
from workers.tiny_checkpoint import released_config, transformers_config
from workers.weights import init_random_weights

HEADS, HEAD_DIM = 16, 72
SDPA_BACKENDS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
REFERENCE_ROWS = 1024
VARLEN_MIX = [(62500, 1), (16384, 1), (4096, 2), (1024, 8)]  # (patches per frame, frames): one busy step
# Server steps of the realistic catalogue (run142's trace): 4,096-16,383 of the tower's patches in most, in a few
# images; the catalogue's median image is 961 visual tokens (62 x 62 patches), its mean 5,288 patches.
DEFAULT_MIXES = "62,62,48;88,62,48,32;124,88,62,48,32"


def parse_configs(text: str) -> list[va.KernelConfig]:
    """'M:N:W:S[:T[:WS[:LZ[:HE]]]]' items: block_m, block_n, warps, stages, T 1 (tensor descriptors, the default)
    or 0, WS 1 (warp-specialised key loop) or 0 (the default), LZ 1 (lazy rescaling) or 0 (the default), HE 1
    (exponentials two at a time in f16, P and V in fp16) or 0 (the default)."""
    configs = []
    for item in filter(None, text.split(",")):
        m, n, w, st, *rest = (int(x) for x in item.split(":"))
        tma, ws, lazy, half = (rest + [1, 0, 0, 0][len(rest):])[:4]
        configs.append(va.KernelConfig(m, n, w, st, bool(tma), bool(ws), bool(lazy), bool(half)))
    return configs


def median_ms(fn, reps: int) -> float:
    """Median of `reps` event-timed calls, in ms, after a warm-up call."""
    return median_us(fn, reps) / 1e3


def queued_ms(fn, reps: int) -> float:
    """ms a call of `reps` calls queued back to back (one pair of events around the loop), after a warm-up call."""
    return time_us(fn, reps) / 1e3


def parse_mixes(text: str) -> list[list[int]]:
    """'S,S,...;S,...' -> per mix, its images' sides in patches (each image S x S patches, one frame)."""
    mixes = [[int(x) for x in item.split(",")] for item in filter(None, text.split(";"))]
    if any(side < 2 or side % 2 for mix in mixes for side in mix):
        raise ValueError(f"--mixes {text!r}: image sides are even patch counts (the tower merges 2 x 2 patches)")
    return mixes


def tower_inputs(patches: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [N, heads, 72] and v, a strided view of a fused qkv, as the tower hands them to attention."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(patches, 3, HEADS, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
    q, k = (torch.randn(patches, HEADS, HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k, qkv[:, 2]


def reference_rows(q, k, v, scale: float, rows: int) -> torch.Tensor:
    """float32 attention of the first `rows` queries against all keys: [rows, heads * dim]."""
    out = []
    for h in range(q.shape[1]):
        s = (q[:rows, h].float() @ k[:, h].float().T) * scale
        out.append(torch.softmax(s, dim=-1) @ v[:, h].float())
    return torch.stack(out, dim=1).reshape(rows, -1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(f"{((got.float() - want).norm() / want.norm()).item():.3g}")


def config_name(impl: str, c: va.KernelConfig) -> str:
    loads = "tma" if c.tma else "ptr"
    flags = ("ws" if c.warp_specialize else "") + ("lz" if c.lazy_rescale else "") + ("he" if c.half_exp else "")
    return f"{impl}[m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}{loads}{flags}]"


def name_of(impl: str, c) -> str:
    if impl == "flash_attn4":
        return impl  # no tiles of ours to name
    if impl == "gluon_fp8":
        return gluon_fp8_name(c)
    return gluon_name(c) if impl == "gluon" else config_name(impl, c)


def gluon_name(c: GluonConfig) -> str:
    return f"gluon[m{c.block_m}n{c.block_n}w{c.num_warps}s{c.stages}]"


def parse_gluon_configs(text: str) -> list[GluonConfig]:
    """'M:N:W:S' items: block_m, block_n, warps, K/V ring stages of the Gluon kernel."""
    return [GluonConfig(*(int(x) for x in item.split(":"))) for item in filter(None, text.split(","))]


def gluon_fp8_name(c: GluonFp8Config) -> str:
    cap = f"r{c.max_registers}" if c.max_registers else ""
    return f"gluon_fp8[m{c.block_m}n{c.block_n}w{c.num_warps}s{c.stages}{cap}]"


def parse_gluon_fp8_configs(text: str) -> list[GluonFp8Config]:
    """'M:N:W:S[:R]' items: block_m, block_n, warps, K/V ring stages, registers a thread at most (0 or left out:
    ptxas's choice) of the FP8 Gluon kernel."""
    return [GluonFp8Config(*(int(x) for x in item.split(":"))) for item in filter(None, text.split(","))]


def bench_kernels(patches: int, configs, fp8_configs, reps: int, device: str, sdpa_names=tuple(SDPA_BACKENDS),
                  gluon_configs=(), flash_attn4: bool = False, gluon_fp8_configs=()) -> dict:
    q, k, v = tower_inputs(patches, device, seed=patches)
    scale = HEAD_DIM**-0.5
    plan = va.AttentionPlan([(patches, 1)])
    flops = plan.useful_flops(HEADS, HEAD_DIM)
    rows = min(REFERENCE_ROWS, patches)
    want = reference_rows(q, k, v, scale, rows)
    out: dict = {"useful_tflop": round(flops / 1e12, 3)}

    def record(name: str, fn) -> None:
        try:
            got = fn()
            ms, queued = median_ms(fn, reps), queued_ms(fn, reps)
        except Exception as exc:  # a backend or tile shape that does not run here: say why, go on
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            return
        out[name] = {"ms": round(ms, 3), "attention_tflops": round(flops / ms / 1e9, 1),
                     "ms_queued": round(queued, 3), "attention_tflops_queued": round(flops / queued / 1e9, 1),
                     "error_vs_fp32": relative_error(got[:rows], want)}

    for name, backend in SDPA_BACKENDS.items():
        if name not in sdpa_names:
            continue

        def sdpa(backend=backend):
            with sdpa_kernel([backend]):
                return va.attention_reference(q, k, v, plan.runs, scale)
        record(name, sdpa)
    for c in configs:
        record(config_name("triton", c), lambda c=c: va.attention_triton(q, k, v, plan, scale, c))
    for c in gluon_configs:
        record(gluon_name(c), lambda c=c: va.vision_attention(q, k, v, plan, scale, "gluon", c))
    for c in gluon_fp8_configs:
        record(gluon_fp8_name(c), lambda c=c: va.vision_attention(q, k, v, plan, scale, "gluon_fp8", c))
    if gluon_fp8_configs:  # the quantisation's share: the operands made for the FP8 Gluon kernel alone
        out["gluon_fp8_quantize_ms"] = round(median_ms(lambda: va.quantize_for_descriptors(
            q, k, v, plan, fp8_gluon.QK_COLS, fp8_gluon.V_ROWS), reps), 3)
    if flash_attn4:
        record("flash_attn4", lambda: va.vision_attention(q, k, v, plan, scale, "flash_attn4"))
    for c in fp8_configs:
        name = config_name("triton_fp8", c)
        record(name, lambda c=c: va.attention_triton_fp8(q, k, v, plan, scale, c))
        if "ms" in out[name]:  # the quantisation's share: the three per-head quantisations alone
            out[name]["quantize_ms"] = round(median_ms(lambda: (va.quantize_per_head(q), va.quantize_per_head(k),
                                                                va.quantize_per_head(v)), reps), 3)
    return out


def bench_varlen(configs: dict, reps: int, device: str, frames: list[tuple[int, int]] = VARLEN_MIX) -> dict:
    """One call over the frames (runs of (patches, frames), VARLEN_MIX's by default): SDPA per run of equal sizes
    against one launch of ours; ms a call alone and queued back to back."""
    patches = sum(n * c for n, c in frames)
    q, k, v = tower_inputs(patches, device, seed=1)
    plan = va.AttentionPlan(frames)
    flops = plan.useful_flops(HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    want = va.attention_reference(q, k, v, plan.runs, scale)
    out: dict = {"frames": [list(r) for r in frames], "useful_tflop": round(flops / 1e12, 3)}
    fns = {"sdpa": lambda: va.attention_reference(q, k, v, plan.runs, scale)}
    for impl, c in configs.items():
        fns[name_of(impl, c)] = lambda impl=impl, c=c: va.vision_attention(q, k, v, plan, scale, impl, c)
    for name, fn in fns.items():
        got = fn()
        ms, queued = median_ms(fn, reps), queued_ms(fn, reps)
        out[name] = {"ms": round(ms, 3), "attention_tflops": round(flops / ms / 1e9, 1),
                     "ms_queued": round(queued, 3), "attention_tflops_queued": round(flops / queued / 1e9, 1),
                     "difference_vs_sdpa": relative_error(got, want.float())}
    return out


def mix_runs(sides: list[int]) -> list[tuple[int, int]]:
    """Images of sides x sides patches, in order -> runs of (patches per frame, consecutive frames of that size),
    as the tower's plan holds them."""
    runs: list[tuple[int, int]] = []
    for side in sides:
        if runs and runs[-1][0] == side * side:
            runs[-1] = (side * side, runs[-1][1] + 1)
        else:
            runs.append((side * side, 1))
    return runs


def bench_mix(module, sides: list[int], configs: dict, reps: int, device: str) -> dict:
    """A step's images of these sides: one attention call over their frames (bench_varlen), and one tower pass with
    each attention ("sdpa", "auto": the product's, and each of configs' with its chosen tiles), ms alone and queued."""
    runs = mix_runs(sides)
    out: dict = {"sides": sides, "patches": sum(n * c for n, c in runs),
                 "attention": bench_varlen(configs, reps, device, runs)}
    in_features = module.patch_embed.proj.weight[0].numel()
    grid = torch.tensor([[1, side, side] for side in sides])
    x = torch.randn(out["patches"], in_features, device=device).to(torch.bfloat16)
    for impl in ("sdpa", "auto", *configs):
        tower = VisionTower(module, gelu_epilogue=True, attention=impl)
        out[f"tower_{impl}_ms"] = round(median_ms(lambda t=tower: t(x, grid), reps), 2)
        out[f"tower_{impl}_ms_queued"] = round(queued_ms(lambda t=tower: t(x, grid), reps), 2)
    return out


def tower_module(device: str, dtype: torch.dtype):
    vision_config = transformers_config(released_config("qwen3-vl-235b-a22b", {})).vision_config
    torch.manual_seed(0)
    module = build_vision_module("moe", vision_config, torch.device(device), dtype)
    init_random_weights(module, seed=0)
    return module.eval()


def bench_tower(module, side: int, accuracy_side: int, configs: dict, reps: int, device: str) -> dict:
    """Our tower with each attention on one side x side image (ms, median), and on accuracy_side its error against
    transformers' float32 module (the same weights)."""
    in_features = module.patch_embed.proj.weight[0].numel()
    towers = {"sdpa": VisionTower(module, gelu_epilogue=True)}
    for impl in configs:
        towers[impl] = VisionTower(module, gelu_epilogue=True, attention=impl)
    out: dict = {"patches": side * side, "pixels": f"{side * 16}x{side * 16}"}
    grid = torch.tensor([[1, side, side]])
    x = torch.randn(side * side, in_features, device=device).to(torch.bfloat16)
    for name, tower in towers.items():
        out[f"{name}_ms"] = round(median_ms(lambda t=tower: t(x, grid), reps), 1)
    # accuracy on the real architecture against transformers' float32 module
    exact = copy.deepcopy(module).float()
    grid = torch.tensor([[1, accuracy_side, accuracy_side]])
    x = torch.randn(accuracy_side**2, in_features, device=device)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = exact(x, grid_thw=grid.to(device), return_dict=True)
    want = [ref.pooler_output, *ref.deepstack_features]
    del exact
    errors = {}
    for name, tower in towers.items():
        embeds, features = tower(x.to(torch.bfloat16), grid)
        errors[name] = max(relative_error(g, w.float()) for g, w in zip([embeds, *features], want))
    hf_bf16 = module(x.to(torch.bfloat16), grid_thw=grid.to(device), return_dict=True)
    errors["transformers_bf16"] = max(relative_error(g, w.float()) for g, w in
                                      zip([hf_bf16.pooler_output, *hf_bf16.deepstack_features], want))
    out["error_vs_transformers_fp32"] = {"patches": accuracy_side**2, **errors}
    return out


class OneRankOfN(TensorParallel):
    """Rank 0 of an n-way split, alone on one GPU: its all-reduces return their input (the bench leaves them out)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def bench_tower_shards(module, side: int, shards: list[int], attention: str, reps: int, device: str) -> dict:
    """One rank's part of the tower split n ways, for each n in shards, on one side x side image: ms (median)."""
    in_features = module.patch_embed.proj.weight[0].numel()
    grid = torch.tensor([[1, side, side]])
    x = torch.randn(side * side, in_features, device=device).to(torch.bfloat16)
    config = module.config
    out: dict = {"patches": side * side, "attention": attention, "all_reduces_left_out": True,
                 "all_reduce_mib_per_pass": round(2 * config.depth * side * side * config.hidden_size * 2 / 2**20)}
    for n in shards:
        tower = VisionTower(copy.deepcopy(module), gelu_epilogue=True, attention=attention, tp=OneRankOfN(0, n))
        out[f"one_rank_of_{n}_ms"] = round(median_ms(lambda t=tower: t(x, grid), reps), 1)
        del tower
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patches", default="4096,16384,35344,62500")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="128:64:4:3,128:64:8:3,128:64:4:4,128:128:8:3,128:64:4:3:0",
                   help="bf16 tiles, M:N:W:S[:T] (T 0: pointer loads)")
    p.add_argument("--fp8-configs", default="128:128:8:3,128:64:8:3", help="FP8 tiles, M:N:W:S")
    p.add_argument("--gluon-configs", default="", help="Gluon kernel (sm_90), M:N:W:S (S: K/V ring stages)")
    p.add_argument("--gluon-fp8-configs", default="", help="FP8 Gluon kernel (sm_90), M:N:W:S[:R] (R: registers a "
                   "thread at most)")
    p.add_argument("--flash-attn4", action="store_true", help="also FlashAttention-4 (the optional flash-attn-4 "
                   "package), in the kernels, the varlen call and the tower")
    p.add_argument("--sdpa", default="sdpa_cudnn,sdpa_flash", help=f"SDPA backends of {sorted(SDPA_BACKENDS)}")
    p.add_argument("--tower-side", type=int, default=250, help="0: no tower figures")
    p.add_argument("--tower-shards", default="", help="n,...: one rank's part of the tower split n ways (no "
                   "all-reduces), on the --tower-side image with the chosen attention")
    p.add_argument("--accuracy-side", type=int, default=128)
    p.add_argument("--mixes", default="", help=f"'S,S,...;...': steps of images S x S patches each, one attention "
                   f"call and one tower pass a step with each attention (realistic: {DEFAULT_MIXES!r})")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or va.triton is None:
        sys.exit("bench_vision_attention: needs CUDA and triton")
    if args.flash_attn4 and not installed_fa4():
        sys.exit(f"bench_vision_attention --flash-attn4: the {FA4_PACKAGE} package is not installed here")
    device = "cuda"
    configs, fp8_configs = parse_configs(args.configs), parse_configs(args.fp8_configs)
    mixes = parse_mixes(args.mixes)
    result: dict = {
        "bench": "vision_attention",
        "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m scripts.bench_vision_attention", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__, "triton": va.triton.__version__, "cudnn": torch.backends.cudnn.version(),
        "heads": HEADS, "head_dim": HEAD_DIM, "reps": args.reps, "kernels": {},
    }
    with torch.inference_mode():
        for n in (int(x) for x in args.patches.split(",")):
            result["kernels"][str(n)] = figures = bench_kernels(n, configs, fp8_configs, args.reps, device,
                                                                      args.sdpa.split(","),
                                                                      parse_gluon_configs(args.gluon_configs),
                                                                      args.flash_attn4,
                                                                      parse_gluon_fp8_configs(args.gluon_fp8_configs))
            print(json.dumps({str(n): {k: v.get("attention_tflops", v.get("error")) for k, v in figures.items()
                                       if isinstance(v, dict)}}), file=sys.stderr, flush=True)
        candidates = {"triton": configs, "triton_fp8": fp8_configs, "gluon": parse_gluon_configs(args.gluon_configs),
                      "gluon_fp8": parse_gluon_fp8_configs(args.gluon_fp8_configs)}
        candidates = {impl: cs for impl, cs in candidates.items() if cs}
        best = {impl: best_config(result["kernels"], impl, cs) for impl, cs in candidates.items()}
        result["best_configs"] = {impl: vars(c) for impl, c in best.items()}
        if args.flash_attn4:
            best["flash_attn4"] = None
        result["varlen"] = bench_varlen(best, args.reps, device)
        va.DEFAULT_CONFIGS.update({impl: c for impl, c in best.items() if c is not None})  # the towers: chosen tiles
        module = tower_module(device, torch.bfloat16) if args.tower_side or mixes else None
        if mixes:
            result["mixes"] = [bench_mix(module, sides, best, args.reps, device) for sides in mixes]
        if args.tower_side:
            result["tower"] = bench_tower(module, args.tower_side, args.accuracy_side, best, max(3, args.reps // 2),
                                          device)
            if args.tower_shards:
                result["tower_shards"] = bench_tower_shards(
                    module, args.tower_side, [int(n) for n in args.tower_shards.split(",")], "auto",
                    max(3, args.reps // 2), device)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result


# a kernel further than this from float32 attention computes something else (FP8's rounding gives ~0.05 on the
# bench's random inputs; a wrong kernel ~1): it never becomes the tower's
MAX_ERROR_VS_FP32 = 0.1


def best_config(kernels: dict, impl: str, configs: list[va.KernelConfig]) -> va.KernelConfig:
    """The tile shape with the highest rate at the largest patch count measured, of those within MAX_ERROR_VS_FP32."""
    largest = kernels[max(kernels, key=int)]
    rates = {c: largest[name_of(impl, c)].get("attention_tflops", 0.0) for c in configs
             if largest[name_of(impl, c)].get("error_vs_fp32", 0.0) < MAX_ERROR_VS_FP32}
    return max(rates, key=rates.get) if rates else va.DEFAULT_CONFIGS[impl]


if __name__ == "__main__":
    main()
