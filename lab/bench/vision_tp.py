"""The vision tower split over n ranks (engine.vision_tensor_parallel) beside the whole tower on one rank, in one run:
one image's pass, n processes with the real collectives (NCCL on GPUs, gloo on the CPU); prints one JSON object.

Each rank builds the same tower (random weights, one seed) on its device: rank r on cuda:r, or the CPU. Then, in
this order, each timed as the median of --reps passes after a warm-up pass (a barrier before each pass, the device
synchronised after it):
- `whole_ms`: rank 0 alone runs the whole tower, as an instance did before the split (the other ranks wait);
- `split_ms`: every rank runs its n-th of the heads and MLP (workers/model/vision.py, shard_vision_blocks), with
  its two all-reduces a block, as the engine's ranks do;
- `all_reduces_ms`: those 2 x depth all-reduces of [patches, hidden] alone, the interconnect's share of split_ms;
- `error_vs_whole`: the split outputs' relative error against the whole tower's (embeddings and DeepStack features,
  the largest).
`--shape tiny` (the tiny checkpoint's dims, float32 on the CPU) is the smoke mode the tests run.
Usage: python -m scripts.bench_vision_tp [--ranks 2] [--shape 235b-a22b|30b-a3b|tiny] [--side 250] [--reps 5]
                                         [--attention auto] [--device cuda|cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lab.bench.vision import PRESETS, preset_vision_config, relative_error
from workers.model.vision import VisionTower, build_vision_module
from workers.parallel import TensorParallel
from workers.weights import init_random_weights


def _median_ms(fn, reps: int, device: torch.device, group_barrier) -> float:
    """Median over reps of one pass: every rank starts after a barrier; the device is synchronised after it."""
    fn()
    times = []
    for _ in range(reps):
        group_barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    """One rank's process; it leaves through os._exit once its group is down. With rank 0 holding the store and the
    ranks leaving through the interpreter's teardown, a rank ended in std::terminate ("terminate called without an
    active exception") in 2 of ~20 two-rank CPU runs; with the store in main() and os._exit, 22 of 22 passed."""
    try:
        _rank_body(rank, args, port, results)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_body(rank: int, args: argparse.Namespace, port: int, results) -> None:
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // args.ranks))  # the ranks share the host's cores
    store = dist.TCPStore("127.0.0.1", port, args.ranks + 1, is_master=False)  # main() holds the store
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=args.ranks)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        config = preset_vision_config(args.shape)
        torch.manual_seed(0)
        module = build_vision_module("moe", config, device, dtype)
        init_random_weights(module, seed=0)
        module.eval()
        gelu = cuda and config.hidden_act == "gelu_pytorch_tanh"
        in_features = module.patch_embed.proj.weight[0].numel()
        grid = torch.tensor([[1, args.side, args.side]])
        pixels = torch.randn(args.side**2, in_features, generator=torch.Generator().manual_seed(1)).to(device, dtype)

        def barrier() -> None:
            dist.barrier(device_ids=[rank]) if cuda else dist.barrier()

        with torch.inference_mode():
            out: dict = {}
            if rank == 0:
                whole = VisionTower(copy.deepcopy(module), gelu_epilogue=gelu, attention=args.attention)
                reference = whole(pixels, grid)
                out["whole_ms"] = round(_median_ms(lambda: whole(pixels, grid), args.reps, device, lambda: None), 2)
                del whole
            barrier()  # the other ranks waited, as they did for a tower on rank 0
            split = VisionTower(module, gelu_epilogue=gelu, attention=args.attention,
                                tp=TensorParallel(rank, args.ranks, group=dist.group.WORLD))
            got = split(pixels, grid)
            out["split_ms"] = round(_median_ms(lambda: split(pixels, grid), args.reps, device, barrier), 2)
            partial = torch.randn(args.side**2, config.hidden_size, device=device, dtype=dtype)

            def all_reduces() -> None:  # the sums grow past bf16's range: an all-reduce's time does not depend on them
                for _ in range(2 * config.depth):
                    dist.all_reduce(partial)

            out["all_reduces_ms"] = round(_median_ms(all_reduces, args.reps, device, barrier), 2)
            if rank == 0:
                (embeds, features), (want_embeds, want_features) = got, reference
                error = relative_error([embeds, *features], [want_embeds, *want_features])
                out["error_vs_whole"] = float(f"{error:.3g}")
                results.put(out)
            barrier()  # no rank tears the group down while another is still in it
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--shape", choices=sorted(PRESETS), default="235b-a22b")
    p.add_argument("--side", type=int, default=None, help="the image's side in patches (default 250, tiny 8)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--attention", default="auto", help="engine.vision_attention")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda, or cpu for --shape tiny")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    args.side = args.side or (8 if args.shape == "tiny" else 250)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"bench_vision_tp: {args.ranks} ranks need {args.ranks} CUDA devices, "
                 f"{torch.cuda.device_count()} here (use --shape tiny for the CPU smoke mode)")
    config = preset_vision_config(args.shape)
    result: dict = {
        "bench": "vision_tp",
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m scripts.bench_vision_tp", *(argv if argv is not None else sys.argv[1:])]),
        "shape": args.shape, "ranks": args.ranks, "patches": args.side**2, "pixels": f"{args.side * 16}px square",
        "attention": args.attention, "heads": config.num_heads, "depth": config.depth, "reps": args.reps,
    }
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    # this process holds the group's store (on a port it picks), so that no rank's exit takes it from the others
    store = dist.TCPStore("127.0.0.1", 0, args.ranks + 1, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_rank, args=(rank, args, store.port, results), name=f"vision-tp-rank-{rank}")
             for rank in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    del store
    failed = [f"{proc.name} (exit {proc.exitcode})" for proc in procs if proc.exitcode]
    if failed or results.empty():
        sys.exit(f"bench_vision_tp: {', '.join(failed) or 'rank 0 reported nothing'}")
    result.update(results.get())
    result["speedup"] = round(result["whole_ms"] / result["split_ms"], 2)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
