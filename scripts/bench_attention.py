"""Paged attention on one GPU at the Qwen3-VL-30B-A3B attention shape (32 q / 4 kv heads, head_dim 128,
16-token blocks): per-sequence SDPA vs the Triton prefill kernel, split vs unsplit decode; prints one JSON object.

Prefill: one layer's attention of a step of multi-row chunks (eager, median of --reps). Decode: 48 calls (one
per layer) captured in a CUDA graph, as the engine replays them; microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workers.model import paged_decode, paged_prefill  # noqa: E402
from workers.model.attention import AttentionMetadata, sdpa_attention, write_kv  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
LAYERS = 48
# (rows, context) per chunk. catalogue: a 1,734-token prompt's tail, four whole prompts, the next one's head.
PREFILL_STEPS = {
    "catalogue": [(478, 1734)] + [(1734, 1734)] * 4 + [(778, 778)],
    "prompts_4x2048": [(2048, 2048)] * 4,
    "later_chunks_4x2048_of_4096": [(2048, 4096)] * 4,
}
DECODES = {"batch1_ctx1800": (1, 1800), "batch64_ctx1800": (64, 1800), "batch256_ctx1024": (256, 1024)}
TILE_SWEEP = [
    paged_prefill.TileConfig(128, 64, 8, 3),
    paged_prefill.TileConfig(128, 128, 8, 3),
    paged_prefill.TileConfig(128, 64, 8, 2),
    paged_prefill.TileConfig(64, 64, 4, 3),
    paged_prefill.TileConfig(128, 32, 8, 3),
]


def paged_step(chunks, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A step over chunks [(rows, context)] (single-row chunks first) whose earlier context is already cached,
    blocks scattered over the pool: (q, this step's k, v, k_cache, v_cache, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-ctx // block_size) for _, ctx in chunks]
    order = torch.randperm(sum(blocks) + 3, generator=gen)
    tables = torch.zeros(len(chunks), max(blocks) + 2, dtype=torch.int32)  # padded wider than needed
    slots, starts, used = [], [0], 0
    for i, ((rows, ctx), count) in enumerate(zip(chunks, blocks)):
        tables[i, :count] = order[used : used + count].int()
        used += count
        slots += [int(tables[i, j // block_size]) * block_size + j % block_size for j in range(ctx - rows, ctx)]
        starts.append(starts[-1] + rows)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    k_cache, v_cache = randn(len(order), block_size, kv_heads, head_dim), randn(len(order), block_size, kv_heads, head_dim)
    q, k, v = randn(starts[-1], heads, head_dim), randn(starts[-1], kv_heads, head_dim), randn(starts[-1], kv_heads, head_dim)
    contexts = [ctx for _, ctx in chunks]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        block_size=block_size,
        num_decodes=sum(rows == 1 for rows, _ in chunks),
        query_starts=starts,
        context_lens_host=contexts,
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def causal_flops(chunks, heads: int, head_dim: int) -> float:
    """QK^T and PV multiply-adds of the visible (query, key) pairs, 2 FLOPs each."""
    pairs = sum(rows * (ctx - rows) + rows * (rows + 1) // 2 for rows, ctx in chunks)
    return 4.0 * heads * head_dim * pairs


def median_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def bench_prefill(chunks, reps: int) -> dict:
    q, k, v, k_cache, v_cache, meta = paged_step(chunks, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    scale = HEAD_DIM**-0.5
    old = torch.empty_like(q)
    sdpa_us = median_us(lambda: sdpa_attention(q, k, v, k_cache, v_cache, meta, scale, old), reps)
    flops = causal_flops(chunks, HEADS, HEAD_DIM)
    result = {
        "rows": meta.query_starts[-1],
        "chunks": chunks,
        "gflop": round(flops / 1e9, 1),
        "sdpa_per_sequence_us": round(sdpa_us, 1),
        "sdpa_tflops": round(flops / sdpa_us / 1e6, 1),
        "triton": {},
    }
    for tiles in TILE_SWEEP:
        new = torch.empty_like(q)
        us = median_us(
            lambda: paged_prefill.prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_starts_device, meta.context_lens,
                0, meta.query_starts[-1], scale, new, tiles,
            ),
            reps,
        )
        result["triton"]["m{}_n{}_w{}_s{}".format(*tiles)] = {
            "us": round(us, 1),
            "tflops": round(flops / us / 1e6, 1),
            "max_abs_diff_vs_sdpa": round((new.float() - old.float()).abs().max().item(), 4),
        }
    default = result["triton"]["m{}_n{}_w{}_s{}".format(*paged_prefill.DEFAULT_TILES)]
    result["default_speedup"] = round(sdpa_us / default["us"], 2)
    result["saved_ms_per_48_layers"] = round((sdpa_us - default["us"]) * LAYERS / 1e3, 2)
    return result


def bench_decode(batch: int, ctx: int, reps: int) -> dict:
    q, _, _, k_cache, v_cache, meta = paged_step([(1, ctx)] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    out = torch.empty_like(q)
    result = {"auto_splits": paged_decode.num_splits(batch, KV_HEADS, torch.cuda.get_device_properties(0).multi_processor_count)}
    for name, splits in (("unsplit", 1), ("split", result["auto_splits"])):
        def layers():
            for _ in range(LAYERS):
                paged_decode.decode_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.context_lens, HEAD_DIM**-0.5, out, splits=splits
                )
        layers()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        result[f"{name}_us_per_layer"] = round(median_us(graph.replay, reps) / LAYERS, 2)
    result["saved_ms_per_48_layers"] = round((result["unsplit_us_per_layer"] - result["split_us_per_layer"]) * LAYERS / 1e3, 3)
    return result


# ---- cuDNN ragged (THD) attention: the fresh chunks of a prefill step, and the vision tower's images ----
VISION_HEADS, VISION_HEAD_DIM = 16, 72
RAGGED_TEXT = {
    # a 16k Offline step of the fixed catalogue: a prompt's continuation, nine whole prompts, the next one's head
    "catalogue_16k": [(478, 1734)] + [(1734, 1734)] * 9 + [(300, 300)],
}


def cudnn_ragged(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """One cuDNN call over packed sequences: q [T, heads, d], k/v [S, kv_heads, d] (contiguous), cu_* [B + 1] int32."""
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu_q, cu_k, max_q, max_k, False, 0.0, causal, False, scale=scale
    )[0]


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1e3, 2)


def bench_ragged_text(chunks, reps: int, seed: int = 0) -> dict:
    q, k, v, k_cache, v_cache, meta = paged_step(chunks, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda", seed)
    scale = HEAD_DIM**-0.5
    starts = meta.query_starts
    fresh = [i for i, (rows, ctx) in enumerate(chunks) if rows == ctx and rows > 1]
    rest = [i for i in range(len(chunks)) if i not in fresh]
    lo, hi = starts[fresh[0]], starts[fresh[-1] + 1]
    if fresh != list(range(fresh[0], fresh[-1] + 1)):
        raise ValueError("the probe wants the fresh chunks contiguous")
    cu = torch.tensor([s - lo for s in starts[fresh[0] : fresh[-1] + 2]], dtype=torch.int32, device="cuda")
    max_len = max(chunks[i][0] for i in fresh)
    qf, kf, vf = q[lo:hi].contiguous(), k[lo:hi].contiguous(), v[lo:hi].contiguous()
    triton_out = torch.empty_like(q)

    def triton_all():
        paged_prefill.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_starts_device,
                                        meta.context_lens, 0, starts[-1], scale, triton_out)

    mixed_out = torch.empty_like(q)

    def ragged_plus_triton():
        mixed_out[lo:hi] = cudnn_ragged(qf, kf, vf, cu, cu, max_len, max_len, True, scale)
        for i in rest:
            paged_prefill.prefill_attention(q, k_cache, v_cache, meta.block_tables[i:], meta.query_starts_device[i:i + 2],
                                            meta.context_lens[i:], starts[i], starts[i + 1], scale, mixed_out)

    def ragged_only():
        cudnn_ragged(qf, kf, vf, cu, cu, max_len, max_len, True, scale)

    first = first_call_ms(ragged_only)
    flops = causal_flops(chunks, HEADS, HEAD_DIM)
    fresh_flops = causal_flops([chunks[i] for i in fresh], HEADS, HEAD_DIM)
    result = {"chunks": chunks, "gflop": round(flops / 1e9, 1), "ragged_first_call_ms": first}
    for name, fn in (("triton_all_us", triton_all), ("ragged_fresh_plus_triton_rest_us", ragged_plus_triton),
                     ("ragged_fresh_only_us", ragged_only)):
        result[name] = round(median_us(fn, reps), 1)
    result["ragged_fresh_tflops"] = round(fresh_flops / result["ragged_fresh_only_us"] / 1e6, 1)
    result["triton_tflops"] = round(flops / result["triton_all_us"] / 1e6, 1)
    triton_all()
    ragged_plus_triton()
    result["max_abs_diff"] = round((mixed_out.float() - triton_out.float()).abs().max().item(), 4)
    # new lengths each call (the realistic catalogue): is a plan built per length set?
    gen = torch.Generator().manual_seed(seed + 1)
    new_calls = []
    for _ in range(4):
        lens = torch.randint(1100, 1900, (8,), generator=gen).tolist()  # at most 15.2k of the step's rows
        cu_new = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        total = sum(lens)
        qn, kn, vn = q[:total].contiguous(), k[:total].contiguous(), v[:total].contiguous()
        new_calls.append(first_call_ms(lambda: cudnn_ragged(qn, kn, vn, cu_new, cu_new, max(lens), max(lens), True, scale)))
    result["ragged_new_lengths_call_ms"] = new_calls
    return result


def bench_ragged_vision(sizes: list[int], reps: int) -> dict:
    """Bidirectional attention over images of `sizes` patches: SDPA per run of equal sizes (the tower today) against
    one ragged cuDNN call."""
    total = sum(sizes)
    q, k, v = (torch.randn(total, VISION_HEADS, VISION_HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = VISION_HEAD_DIM**-0.5
    runs = []
    for s in sizes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    ref = torch.empty_like(q)

    def per_run():
        start = 0
        for length, count in runs:
            end = start + length * count
            qs, ks, vs = (t[start:end].view(count, length, VISION_HEADS, -1).transpose(1, 2) for t in (q, k, v))
            ref[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2).reshape(end - start, VISION_HEADS, -1)
            start = end

    cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = {}

    def ragged():
        out["o"] = cudnn_ragged(q, k, v, cu, cu, max(sizes), max(sizes), False, scale)

    first_sdpa, first_ragged = first_call_ms(per_run), first_call_ms(ragged)
    flops = 4.0 * VISION_HEADS * VISION_HEAD_DIM * sum(s * s for s in sizes)
    result = {"images": len(sizes), "patches": total, "gflop": round(flops / 1e9, 1),
              "sdpa_first_call_ms": first_sdpa, "ragged_first_call_ms": first_ragged}
    for name, fn in (("sdpa_per_run_us", per_run), ("ragged_us", ragged)):
        result[name] = round(median_us(fn, reps), 1)
        result[name.replace("_us", "_tflops")] = round(flops / result[name] / 1e6, 1)
    per_run()
    ragged()
    result["max_abs_diff"] = round((out["o"].float() - ref.float()).abs().max().item(), 4)
    return result


def bench_ragged(reps: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    mixed = sorted(torch.randint(600, 6000, (10,), generator=gen).tolist())
    mixed2 = torch.randint(600, 6000, (10,), generator=gen).tolist()
    return {
        "text": {name: bench_ragged_text(chunks, reps) for name, chunks in RAGGED_TEXT.items()},
        "vision": {"10x4096": bench_ragged_vision([4096] * 10, reps),
                   "10_mixed_sizes": bench_ragged_vision(mixed, reps),
                   "10_other_sizes": bench_ragged_vision(mixed2, reps)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--only-ragged", action="store_true", help="only the cuDNN ragged comparisons")
    args = parser.parse_args()
    if not torch.cuda.is_available() or paged_decode.triton is None:
        sys.exit("bench_attention needs CUDA and triton")
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": paged_decode.triton.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
    }
    if not args.only_ragged:
        result["prefill_one_layer"] = {name: bench_prefill(chunks, args.reps) for name, chunks in PREFILL_STEPS.items()}
        result["decode_graph_replay"] = {name: bench_decode(b, ctx, args.reps) for name, (b, ctx) in DECODES.items()}
    result["cudnn_ragged"] = bench_ragged(args.reps)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
