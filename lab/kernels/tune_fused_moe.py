"""Times candidate tile configurations of the fused MoE GEMMs per token count and writes the fastest to a tuned
table (workers/model/fused_moe_configs/{device}.json, read by workers.model.fused_moe.tile_config, or --out).
With --compare it writes nothing and prints one JSON object: the experts per token count with two tuned tables side
by side (before/after), the after table's parts (align, gated GEMM, down GEMM, k-sum) and the whole MoE layer.

Usage (on the GPU): python3 scripts/tune_fused_moe.py [--out FILE] [--tokens 16,64,...]
                    python3 scripts/tune_fused_moe.py --compare [--before OLD.json] [--after NEW.json]
CPU smoke (Triton's interpreter, tiny shapes, wall-clock times that mean nothing):
  TRITON_INTERPRET=1 python3 scripts/tune_fused_moe.py --smoke [--compare]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import astuple, replace
from pathlib import Path

import torch


from workers.model import fused_moe
from workers.model.fused_moe import TileConfig
from workers.model.moe import SparseMoeBlock

TOKENS = (16, 64, 256, 1024, 4096, 8192, 16384)  # up to fused_moe.SMALL_BATCH_TOKENS the GEMV kernels run instead
COMPARE_TOKENS = (1, 64, 256, 4096, 8192, 16384)
SMALL_PAIRS = 512  # up to this many pairs experts see a few rows each: the weights stream, BLOCK_M stays 16
SMALL = [TileConfig(16, n, k, 4, s, 1) for n in (64, 128) for k in (64, 128) for s in (3, 5)]
# Above SMALL_PAIRS both GEMMs take one BLOCK_M (one alignment of the pairs). The gated kernel holds two
# BLOCK_M x BLOCK_N accumulators (gate and up), so its BLOCK_N is half the down kernel's.
LARGE_GATED = [
    TileConfig(*c) for c in (
        (32, 128, 64, 4, 4, 1), (64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (64, 128, 64, 8, 3, 8),
        (128, 64, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 128, 64, 8, 4, 8),
    )
]
LARGE_DOWN = [
    TileConfig(*c) for c in (
        (32, 256, 64, 8, 4, 1), (64, 128, 64, 4, 4, 1), (64, 256, 64, 8, 4, 1), (64, 256, 64, 4, 3, 8),
        (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1), (128, 256, 64, 8, 3, 8),
    )
]

# --wide (prefill-sized pair counts): deeper K tiles, more pipeline stages, BLOCK_M 256, launch orders; each fits
# the H200's 227 KB of shared memory (stages x (BLOCK_M + B tiles x BLOCK_N) x BLOCK_K x 2 bytes).
WIDE_GATED = LARGE_GATED + [
    TileConfig(*c) for c in (
        (128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 2, 1), (128, 128, 32, 8, 6, 1), (128, 64, 128, 4, 3, 1),
        (256, 64, 64, 8, 4, 1), (256, 64, 64, 8, 3, 8), (64, 128, 64, 4, 5, 1),
    )
]
WIDE_DOWN = LARGE_DOWN + [
    TileConfig(*c) for c in (
        (128, 128, 128, 4, 3, 1), (128, 256, 128, 8, 2, 1), (128, 256, 32, 8, 6, 1), (128, 128, 64, 8, 5, 1),
        (256, 128, 64, 8, 4, 1), (256, 128, 64, 8, 3, 8), (64, 256, 64, 4, 4, 1),
    )
]


@contextlib.contextmanager
def patched(module, **values):
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def timer(device: str):
    """us per fn() call: CUDA events over a loop on the GPU; on CPU (the interpreter smoke) wall clock, once."""
    if device != "cuda":
        def wall_us(fn) -> float:
            fn()
            start = time.perf_counter()
            fn()
            return round((time.perf_counter() - start) * 1e6, 1)
        return wall_us

    from lab.bench.gpu_timing import time_us

    return lambda fn, iters=20: round(time_us(fn, iters), 1)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def problem(tokens: int, e: int, h: int, k: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], top_w [T, k], top_i [T, k]: k distinct experts per token, uniformly at random."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(tokens, h, device=device, generator=gen).to(dtype)
    top_i = torch.rand(tokens, e, device=device, generator=gen).topk(k, dim=-1).indices
    top_w = torch.rand(tokens, k, device=device, generator=gen).to(dtype)
    return x, top_w, top_i


def expert_weights(e: int, h: int, i: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gate_up = (torch.randn(e, 2 * i, h, device=device, generator=gen) * 0.02).to(dtype)
    down = (torch.randn(e, h, i, device=device, generator=gen) * 0.02).to(dtype)
    return gate_up, down


def tflops(pairs: int, h: int, i: int, us: float) -> float:
    return round(2 * pairs * 3 * i * h / us / 1e6, 1)  # gate, up and down: 3 * I * H multiply-adds per pair


def tune(e: int, h: int, i: int, k: int, tokens_list, device: str, small: list[TileConfig],
         large: tuple[list[TileConfig], list[TileConfig]]) -> dict[str, list]:
    """The fastest configs per token count as table rows, every candidate's time printed as it goes; above
    SMALL_PAIRS the gated and down configs of the one BLOCK_M with the least time for both."""
    time_fn = timer(device)
    gate_up, down = expert_weights(e, h, i, device)
    keys = fused_moe.shape_key(e, i, h, True), fused_moe.shape_key(e, h, i, False)
    table: dict[str, list] = {key: [] for key in keys}
    for tokens in tokens_list:
        pairs = tokens * k
        x, top_w, top_i = problem(tokens, e, h, k, device, seed=tokens)
        act, ys = x.new_empty(pairs, i), x.new_empty(pairs, h)
        spaces = (small, small) if pairs <= SMALL_PAIRS else large
        timed: list[dict[TileConfig, float]] = [{}, {}]
        for gated, key, space, times in zip((True, False), keys, spaces, timed):
            for cfg in space:
                ids, experts = fused_moe.align_pairs(top_i, e, cfg.block_m)
                if gated:
                    run = lambda: fused_moe._gemm(x, gate_up, act, None, ids, experts, k, True, cfg)  # noqa: E731
                else:
                    run = lambda: fused_moe._gemm(act, down, ys, top_w.reshape(-1), ids, experts, 1, False, cfg)  # noqa: E731
                try:
                    times[cfg] = us = time_fn(run)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile (e.g. shared memory)
                    print(f"T={tokens} {key} {astuple(cfg)}: {type(exc).__name__}", flush=True)
                    continue
                flops = 2 * pairs * (2 * i if gated else i) * h
                print(f"T={tokens:5d} {key:26s} {astuple(cfg)} {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
        if pairs <= SMALL_PAIRS:
            best = [min(times, key=times.get) for times in timed]
        else:
            block_ms = {cfg.block_m for cfg in timed[0]} & {cfg.block_m for cfg in timed[1]}
            best = min(([min((c for c in times if c.block_m == m), key=times.get) for times in timed] for m in block_ms),
                       key=lambda pair: timed[0][pair[0]] + timed[1][pair[1]])
        for key, times, cfg in zip(keys, timed, best):
            print(f"T={tokens:5d} {key:26s} best {astuple(cfg)} {times[cfg]:8.1f} us", flush=True)
            table[key].append([pairs, list(astuple(cfg))])
    return table


def compare(e: int, h: int, i: int, k: int, tokens_list, device: str, before_path: Path | None, after_path: Path | None) -> dict:
    """Experts time per token count with two tuned tables side by side (each defaults to the one this device
    reads), the parts with the "after" table (align, gated GEMM, down GEMM, k-sum), and the whole MoE layer
    (router + experts, with the "after" table)."""
    time_fn = timer(device)
    name = device_name(device)
    gate_up, down = expert_weights(e, h, i, device)
    tables = {label: fused_moe.read_table(path) if path else fused_moe._tuned(name)
              for label, path in (("before", before_path), ("after", after_path))}
    torch.manual_seed(0)
    block = SparseMoeBlock(e, k, h, i).to(device, gate_up.dtype)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    keys = fused_moe.shape_key(e, i, h, True), fused_moe.shape_key(e, h, i, False)
    out: dict = {"device": name, "experts": e, "hidden": h, "inter": i, "top_k": k,
                 "tables": {label: str(path or "this device's") for label, path in (("before", before_path), ("after", after_path))},
                 "small_batch_tokens": fused_moe.SMALL_BATCH_TOKENS, "experts_us": {"before": {}, "after": {}},
                 "tflops": {"before": {}, "after": {}}, "after_parts_us": {}, "layer_us": {}, "configs": {}}
    for tokens in tokens_list:
        t, pairs = str(tokens), tokens * k
        x, top_w, top_i = problem(tokens, e, h, k, device, seed=tokens)
        for label, table in tables.items():
            with patched(fused_moe, _tuned=lambda _name, table=table: table):
                us = time_fn(lambda: fused_moe.fused_experts(x, top_w, top_i, gate_up, down))
            out["experts_us"][label][t] = us
            out["tflops"][label][t] = tflops(pairs, h, i, us)
        if tokens <= fused_moe.SMALL_BATCH_TOKENS:  # the GEMV kernels: no tiles
            continue
        with patched(fused_moe, _tuned=lambda _name: tables["after"]), torch.no_grad():
            out["layer_us"][t] = time_fn(lambda: block(x))
            cfgs = [fused_moe.tile_config(pairs, gated, key, name) for gated, key in zip((True, False), keys)]
        out["configs"][t] = [list(astuple(cfg)) for cfg in cfgs]
        ids = [fused_moe.align_pairs(top_i, e, cfg.block_m) for cfg in cfgs]
        act, ys = x.new_empty(pairs, i), x.new_empty(pairs, h)
        out["after_parts_us"][t] = {
            "align": time_fn(lambda: fused_moe.align_pairs(top_i, e, cfgs[0].block_m)),
            "gated": time_fn(lambda: fused_moe._gemm(x, gate_up, act, None, *ids[0], k, True, cfgs[0])),
            "down": time_fn(lambda: fused_moe._gemm(act, down, ys, top_w.reshape(-1), *ids[1], 1, False, cfgs[1])),
            "k_sum": time_fn(lambda: fused_moe.k_sum(ys, k)),
            "k_sum_torch": time_fn(lambda: ys.view(tokens, k, h).sum(dim=1)),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="store_true", help="print before/after JSON, write nothing")
    p.add_argument("--before", type=Path, help="--compare: the tuned table before (default: this device's)")
    p.add_argument("--after", type=Path, help="--compare: the tuned table after (default: this device's)")
    p.add_argument("--out", type=Path, help="where the tuned table goes (default: the table this device reads); "
                                            "rows of pair counts not tuned now are kept from this device's table")
    p.add_argument("--tokens", help="comma-separated token counts (default: the tuning or compare set)")
    p.add_argument("--wide", action="store_true", help="a wider search above the small pair counts (WIDE_GATED/WIDE_DOWN)")
    p.add_argument("--tma", action="store_true", help="above the small pair counts, every candidate also with its "
                   "weight tiles read through TMA (TileConfig.tma)")
    p.add_argument("--smoke", action="store_true", help="CPU and tiny shapes (TRITON_INTERPRET=1): checks the script runs")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    device = "cuda"
    tokens_list = [int(t) for t in args.tokens.split(",")] if args.tokens else COMPARE_TOKENS if args.compare else TOKENS
    small, large = SMALL, (WIDE_GATED, WIDE_DOWN) if args.wide else (LARGE_GATED, LARGE_DOWN)
    if args.tma:
        large = tuple(space + [replace(cfg, tma=1) for cfg in space] for space in large)
    if args.smoke:
        device, (e, h, i, k), tokens_list = "cpu", (8, 64, 32, 2), [1, 12, 300]
        small, large = SMALL[:1], ([TileConfig(16, 32, 32, 4, 1, 0), TileConfig(16, 16, 32, 4, 1, 2)],) * 2
    if args.compare:
        print(json.dumps(compare(e, h, i, k, tokens_list, device, args.before, args.after)), flush=True)
        return
    text = fused_moe.table_text(fused_moe.merged_table(fused_moe._tuned(device_name(device)), tune(e, h, i, k, tokens_list, device, small, large)))
    if args.smoke and args.out is None:
        print(text, end="")
        return
    out = args.out or fused_moe.TUNED_DIR / f"{device_name(device).replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")

