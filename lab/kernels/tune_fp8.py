"""Sweeps the FP8 kernels' tile configs on one GPU beside the bf16 kernels, at the Qwen3-VL-30B-A3B layer shapes;
prints one JSON object (every config's time, the best of each, bf16's time).

Dense: the Triton W8A8 GEMM (fp8_gemm.w8a8_gemm) on q/k/v and o. MoE: the tiled fp8 experts, sweeping the gated
GEMM's tiles with the down GEMM's default, then the down GEMM's with the gated default, on per-channel weight scales
(the FP8-dynamic layout) and re-timing the fastest on 128x128 blocks (the released FP8 layout). Decode-sized steps
(at most 4,096 token-expert pairs, e.g. --moe-tokens 64,256,512) sweep 16- and 32-row tiles, where the weights'
bytes set the time. CUDA-graph replay, median. --table-out writes the tuned ",fp8" rows into a copy of this device's
MoE table (workers/model/fused_moe_configs), for bench_engine.py --moe-configs and then the repository.
Usage: python scripts/tune_fp8.py [--tokens 8192,16384] [--moe-tokens 16384] [--out FILE] [--table-out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import astuple
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.bench.gpu_timing import graph_median_us
from workers.checkpoint_quant import BlockShape
from workers.model import fp8, fp8_gemm, fused_moe
from workers.model.fused_moe import TileConfig

DENSE = {"qkv_2048x5120": (5120, 2048), "o_4096x2048": (2048, 4096)}
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
BLOCK = BlockShape(128, 128)


def _time(fn) -> float | str:
    try:
        fn()
        torch.cuda.synchronize()
        return round(graph_median_us(fn, calls=5, reps=10), 2)
    except Exception as exc:  # a config that does not compile or fit: recorded, not fatal
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def dense(tokens: int) -> dict:
    out = {}
    for name, (n, k) in DENSE.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = fp8.quantize_weight_blocks(w, BLOCK)
        wb = w.bfloat16()
        xq, xs = fp8_gemm.quantize_activations(x)
        rows = {"bf16": _time(lambda: F.linear(x, wb)), "fp8_default": _time(lambda: fp8_gemm.w8a8_gemm(xq, xs, wq, ws, BLOCK, x.dtype))}
        for bm, bn, warps, stages, gm in itertools.product((64, 128), (128, 256), (4, 8), (3, 4), (8,)):
            cfg = fp8_gemm.GemmConfig(bm, bn, warps, stages, gm)
            rows[f"{bm}x{bn} w{warps} s{stages}"] = _time(lambda cfg=cfg: fp8_gemm.w8a8_gemm(xq, xs, wq, ws, BLOCK, x.dtype, cfg=cfg))
        out[name] = rows
    return out


def moe_problem(tokens: int, scales: str) -> tuple:
    """Random experts of the 30B-A3B shape in FP8 and one step's routing: (x, top_w, top_i, gate_up, down, kwargs,
    bf16 gate_up, bf16 down). scales "block": 128x128 weight blocks (the released FP8 layout); "channel": one scale
    per output row, seen as the engine's MoeExperts sees it (rows of 1 x 128 blocks, stride 0 along K)."""
    torch.manual_seed(0)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    top_w, top_i = torch.topk(logits.softmax(-1), TOP_K)
    if scales == "block":
        (gq, gs), (dq, ds) = fp8.quantize_weight_blocks(gate_up, BLOCK), fp8.quantize_weight_blocks(down, BLOCK)
        kwargs = dict(gate_up_scale=gs, down_scale=ds, block=BLOCK)
    else:
        row = BlockShape(1, fused_moe.FP8_BLOCK_K)
        (gq, gs), (dq, ds) = (fp8.quantize_weight_blocks(w, BlockShape(1, w.shape[2])) for w in (gate_up, down))
        kwargs = dict(gate_up_scale=gs.expand(EXPERTS, *row.grid(2 * INTER, HIDDEN)),
                      down_scale=ds.expand(EXPERTS, *row.grid(HIDDEN, INTER)), block=row)
    return x, top_w.bfloat16(), top_i, gq, dq, kwargs, gate_up, down


def moe_candidates(pairs: int, gated: bool) -> list[TileConfig]:
    """The sweep's tiles for one GEMM: decode-sized steps (experts see a few rows each, the weights stream) 16- and
    32-row tiles, column order; prefill-sized ones 64- and 128-row tiles, grouped launch order."""
    decode_sized = pairs <= fused_moe.HEURISTIC_PAIR_BOUNDS[1]
    rows_per_tile = (16, 32) if decode_sized else (64, 128)
    group_m = 1 if decode_sized else 8
    widths = (128,) if gated else ((64, 128, 256) if decode_sized else (128, 256))  # gated fp8: one scale block
    stage_counts = (3, 4, 5) if decode_sized else (2, 3, 4)
    return [TileConfig(bm, bn, fused_moe.FP8_BLOCK_K, warps, stages, group_m, tma)
            for bm, bn, warps, stages, tma in itertools.product(rows_per_tile, widths, (4, 8), stage_counts, (0, 1))]


def moe(tokens: int, scales: str, only: dict[bool, list[TileConfig]] | None = None) -> dict:
    """One step of `tokens` tokens: bf16 experts, the fp8 defaults, then each candidate of the gated GEMM (the
    down GEMM on its default) and of the down GEMM (gated on its default). only: those candidates instead."""
    x, top_w, top_i, gq, dq, kwargs, gate_up, down = moe_problem(tokens, scales)
    rows = {
        "bf16": _time(lambda: fused_moe.fused_experts(x, top_w, top_i, gate_up, down)),
        "fp8_default": _time(lambda: fused_moe.fused_experts(x, top_w, top_i, gq, dq, **kwargs)),
    }
    original = fused_moe.tile_config
    pairs = tokens * TOP_K
    default = {g: original(pairs, g, None, None, True) for g in (True, False)}
    try:
        for gated in (True, False):
            for cfg in (only or {}).get(gated, moe_candidates(pairs, gated)):
                fused_moe.tile_config = lambda n, g, *a, cfg=cfg, gated=gated, **k: cfg if g == gated else default[g]
                rows[moe_row_key(gated, cfg)] = _time(lambda: fused_moe.fused_experts(x, top_w, top_i, gq, dq, **kwargs))
    finally:
        fused_moe.tile_config = original
    return rows


def moe_row_key(gated: bool, cfg: TileConfig) -> str:
    return (f"{'gated' if gated else 'down'} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"g{cfg.group_m} tma{cfg.tma}")


def moe_fastest(rows: dict, gated: bool, count: int) -> list[TileConfig]:
    """The `count` fastest candidates of one GEMM in a sweep's rows."""
    prefix = "gated " if gated else "down "
    timed = sorted((v, k) for k, v in rows.items() if k.startswith(prefix) and isinstance(v, float))
    return [_parse_row_key(k) for _, k in timed[:count]]


def _parse_row_key(key: str) -> TileConfig:
    _, tile, warps, stages, group, tma = key.split()
    bm, bn = (int(v) for v in tile.split("x"))
    return TileConfig(bm, bn, fused_moe.FP8_BLOCK_K, int(warps[1:]), int(stages[1:]), int(group[1:]), int(tma[3:]))


def fp8_table_rows(sweeps: dict[int, dict[str, dict]]) -> dict[str, list]:
    """The ",fp8" rows of a tuned table from the MoE sweeps ({tokens: {scales: rows}}): at each swept step's pair
    count, the candidate of each GEMM with the least time summed over the scale layouts swept (one table serves
    both); and at each bound where tile_config's untuned choice changes, and past the largest step, a row with that
    choice, so that steps of sizes not swept keep their untuned tiles (a row covers the pair counts above the row
    before it)."""
    out: dict[str, list] = {}
    keys = {True: fused_moe.shape_key(EXPERTS, INTER, HIDDEN, True, True),
            False: fused_moe.shape_key(EXPERTS, HIDDEN, INTER, False, True)}
    for gated, key in keys.items():
        rows = []
        for tokens in sorted(sweeps):
            layouts = list(sweeps[tokens].values())
            common = set.intersection(*({k for k, v in r.items() if k.startswith("gated " if gated else "down ")
                                         and isinstance(v, float)} for r in layouts))
            if common:
                fastest = min(common, key=lambda k: sum(r[k] for r in layouts))
                rows.append([tokens * TOP_K, list(astuple(_parse_row_key(fastest)))])
        tuned = {pairs for pairs, _ in rows}
        bounds = [b for b in (*fused_moe.HEURISTIC_PAIR_BOUNDS, LARGEST_PAIRS) if b not in tuned]
        rows += [[b, list(astuple(fused_moe.tile_config(b, gated, None, None, True)))] for b in bounds]
        out[key] = sorted(rows)
    return out


LARGEST_PAIRS = 1 << 22  # a table's last row covers every larger step too


def best(rows: dict) -> dict:
    timed = {k: v for k, v in rows.items() if isinstance(v, float)}
    out = {"bf16": rows.get("bf16"), "fp8_default": rows.get("fp8_default")}
    for prefix in ("gated", "down", ""):
        cands = {k: v for k, v in timed.items() if k not in out and (k.startswith(prefix) if prefix else k[0].isdigit())}
        if cands:
            key = min(cands, key=cands.get)
            out[f"best{'_' + prefix if prefix else ''}"] = [key, cands[key]]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384", help="the dense sweep's step sizes ('' for none)")
    p.add_argument("--moe-tokens", default="16384", help="the MoE sweep's step sizes ('' for none; 24 gated + 72 "
                   "down candidates each at decode sizes, 24 + 48 at prefill sizes)")
    p.add_argument("--moe-scales", default="channel,block", help="the MoE weights' scale layouts, comma-separated: "
                   "the first is swept whole, the others time its --retime fastest candidates of each GEMM")
    p.add_argument("--retime", type=int, default=8)
    p.add_argument("--out", type=Path, help="every time, rewritten after each sweep")
    p.add_argument("--table-out", type=Path, help="this device's tuned MoE table with the MoE sweep's \",fp8\" rows "
                   "(fused_moe_configs/{device}.json's layout); read it with bench_engine.py --moe-configs DIR")
    args = p.parse_args(argv)
    split = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    layouts = [v for v in args.moe_scales.split(",") if v]
    if not layouts or set(layouts) - {"block", "channel"}:
        p.error(f"--moe-scales: expected block and/or channel, got {args.moe_scales!r}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": sys.argv, "dense": {}, "moe": {}}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    for t in split(args.tokens):
        result["dense"][t] = {name: {"all": rows, "best": best(rows)} for name, rows in dense(t).items()}
        save()
    sweeps: dict[int, dict[str, dict]] = {}
    for t in split(args.moe_tokens):
        for n, layout in enumerate(layouts):
            primary = sweeps.get(t, {}).get(layouts[0])
            only = None if n == 0 else {g: moe_fastest(primary, g, args.retime) for g in (True, False)}
            rows = moe(t, layout, only)
            sweeps.setdefault(t, {})[layout] = rows
            result["moe"].setdefault(t, {})[layout] = {"all": rows, "best": best(rows)}
            save()
        # after each step size, so that a sweep cut short still leaves the table of the sizes it finished
        result["fp8_table_rows"] = fp8_table_rows(sweeps)
        save()
        if args.table_out:
            table = fused_moe.merged_table(fused_moe._tuned(torch.cuda.get_device_name()), result["fp8_table_rows"])
            args.table_out.parent.mkdir(parents=True, exist_ok=True)
            args.table_out.write_text(fused_moe.table_text(table))
    print(json.dumps({t: {n: v["best"] for n, v in d.items()} for t, d in result["dense"].items()}))
    print(json.dumps({"moe": {t: {lay: v["best"] for lay, v in d.items()} for t, d in result["moe"].items()},
                      "fp8_table_rows": result.get("fp8_table_rows")}))
    return result

