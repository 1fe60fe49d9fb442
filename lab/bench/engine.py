"""Engine speed on random weights of a real Qwen3-VL shape (no checkpoint on disk), with the transformers
baseline on the same workload; prints one JSON object (and writes it to --out).

Our engine and the baseline each hold a full copy of the weights, so on CUDA each runs in its own
subprocess, one after the other. `--shape tiny` is a CPU smoke mode with tiny dims.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path


from lab.bench.engine_baseline import bench_baseline
from lab.bench.engine_ours import bench_ours
from lab.bench.engine_setup import PRECISIONS, PRESETS, Workload, write_config

REPO = Path(__file__).resolve().parents[2]
COMMAND_LINE = REPO / "scripts" / "bench_engine.py"  # each CUDA part runs as this command line with --part


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=sorted(PRESETS), default="30b-a3b")
    p.add_argument("--num-layers", type=int, default=None, help="fewer text layers for quick runs")
    p.add_argument("--samples", type=int, default=None, help="catalogue samples (default 256; tiny 4)")
    p.add_argument("--workloads", default=None, help="catalogue workloads, comma-separated: fixed (the issue's "
                   "one-image-size workload), realistic (synthetic catalogue with the real dataset's statistics); "
                   "default both, tiny: fixed; none: only the vision, MoE, prefill and decode figures")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's step budget (default 8192; "
                   "the prefill figure then runs steps of this many tokens)")
    p.add_argument("--decode-batches", type=_batch_sizes, default=None, metavar="B,...", help="the decode part's "
                   "batch sizes, each after the one before (default 1,64,256; tiny 1,4)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's most running sequences (default 512, as h200x1.yaml)")
    p.add_argument("--catalogue-only", action="store_true", help="only the catalogue workloads, each once (no vision, "
                   "MoE, prefill and decode figures, no prepared-first rerun)")
    p.add_argument("--no-encode-ahead", action="store_true", help="images encoded in the step that first needs "
                   "them, not behind the previous step's sampling (EngineConfig.encode_ahead)")
    p.add_argument("--no-warm-up", action="store_true", help="no engine warm-up before the first request "
                   "(EngineConfig.warm_up: kernels compile and cuDNN plans are built inside the first catalogue run)")
    p.add_argument("--repeat-fixed", type=int, default=1, help="run the fixed catalogue this many times on the same "
                   "engine (catalogue_run2, ...): a warm engine's figures beside the first run's")
    p.add_argument("--prefill-pointer-loads", action="store_true", help="the prefill attention kernel gathers every "
                   "chunk's K/V from the paged cache (paged_prefill.POINTER_TILES), also where the device has TMA")
    p.add_argument("--precisions", default="bf16", help="comma-separated, each ours run in the same call: bf16, fp8 "
                   "(FP8 weights in 128x128 blocks, W8A8 GEMMs; with --fp8-kv-cache also an FP8 KV cache), "
                   "fp8-dequantized (the FP8 checkpoint dequantized to bf16 at load: engine.fp8_compute dequantize), "
                   "fp8-channel (the FP8-dynamic layout: per-channel weights, per-token activations, row-wise GEMMs)")
    p.add_argument("--fp8-kv-cache", action="store_true", help="the fp8 precision's run also stores the KV cache in FP8")
    p.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--fp8-compute", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--overlap-ab", action="store_true", help="the fixed catalogue also again (warm), and with 16 "
                   "preparation threads instead of the engine's preprocess_threads: what overlapping costs the steps")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (to measure their effect)")
    p.add_argument("--overlap-decode-steps", action="store_true", help="engine.overlap_decode_steps: a decode-only "
                   "step's successor is scheduled and queued while it runs (run the bench with and without it, "
                   "interleaved, for an A/B)")
    p.add_argument("--mixed-step-graphs", choices=["on", "off", "both"], default="on", help="steps with prompt "
                   "chunks through piecewise CUDA graphs (engine.mixed_step_graphs); both: each precision twice, off "
                   "(keys ..._eager_steps) then on, in the same call")
    p.add_argument("--layer-fusions", choices=["on", "off", "both"], default="on", help="the fused launches of a "
                   "text layer (residual add + RMSNorm + FP8 quantisation, the router's top-k + alignment); off: each "
                   "launched apart, as before them; both: each precision twice, off (keys ..._unfused) then on")
    p.add_argument("--sampling", choices=["greedy", "model-defaults"], default="greedy", help="how our engine's "
                   "requests pick tokens: greedy (the transformers baseline's), or the released checkpoints' "
                   "generation_config.json defaults (temperature 0.7, top-p 0.8, top-k 20), which MLPerf's requests "
                   "ask for through the product path")
    p.add_argument("--moe-configs", type=Path, default=None, help="a folder of tuned MoE tile tables to read "
                   "instead of workers/model/fused_moe_configs (scripts/tune_fp8.py --table-out writes one)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--part-timeout", type=float, default=1800, help="seconds each CUDA part may run")
    p.add_argument("--device", default=None, help="default: cuda, or cpu for --shape tiny")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile-out", type=Path, default=None, help="torch.profiler tables of the fixed catalogue's steps 2-3 (images still being prepared), 20-21 (host ops) and 40-41")
    p.add_argument("--profile-decode", type=Path, default=None, help="torch.profiler tables of 8 decode steps at the "
                   "largest decode batch by GPU time, then of 8 more by host time (the host's ops recorded too), appended "
                   "to this file per precision, with the GPU's busy share of their wall time (decode_profile in the JSON)")
    p.add_argument("--profile-prefill", type=Path, default=None, help="torch.profiler tables of 2 text-prefill steps "
                   "(the prefill part's prompts again, max-num-batched-tokens a step) by GPU time, appended to this file "
                   "per precision, with the GPU's busy share of their wall time (prefill_profile in the JSON)")
    p.add_argument("--beside-tower", default=None, metavar="SIDE,...", help="after the decode figures, a tower pass "
                   "of a square image of SIDE patches a side (188: 3,000 px, 250: 4,000 px) beside decode steps, once "
                   "per --beside-sms entry (lab/bench/tower_beside_decode.py; CUDA only)")
    p.add_argument("--beside-sms", default="0", metavar="N,...", help="with --beside-tower: 0 for the tower on a "
                   "plain second stream, N for a green context of N SMs (default 0)")
    p.add_argument("--beside-batch", type=int, default=4, help="with --beside-tower: decoding requests (default 4)")
    p.add_argument("--beside-context", type=int, default=8192, help="with --beside-tower: their prompt tokens")
    p.add_argument("--part", choices=["all", "ours", "baseline"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--config-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.shape == "tiny" else "cuda"
    if args.workloads is None:
        args.workloads = "fixed" if args.shape == "tiny" else "fixed,realistic"
    from lab.bench.catalogue_workload import WORKLOADS

    if set(args.precisions.split(",")) - set(PRECISIONS):
        p.error(f"--precisions: expected some of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    if args.workloads == "none":
        if args.catalogue_only or not args.skip_baseline:
            p.error("--workloads none leaves no catalogue: it needs --skip-baseline and no --catalogue-only")
        args.workloads = ""
    unknown = set(args.workloads.split(",")) - set(WORKLOADS) - {""}
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; expected some of {list(WORKLOADS)}, or none")
    for flag, path in (("--profile-decode", args.profile_decode), ("--profile-prefill", args.profile_prefill)):
        if path is not None and not args.device.startswith("cuda"):
            p.error(f"{flag} profiles CUDA kernels: it needs a CUDA device")
    args.beside = None
    if args.beside_tower is not None:
        if not args.device.startswith("cuda"):
            p.error("--beside-tower runs the tower beside CUDA decode steps: it needs a CUDA device")
        if args.catalogue_only:
            p.error("--beside-tower is one of the parts --catalogue-only leaves out")
        from lab.bench.tower_beside_decode import BesideTower

        try:
            args.beside = BesideTower.parse(args.beside_tower, args.beside_sms, args.beside_batch, args.beside_context)
        except ValueError as exc:
            p.error(str(exc))
    if args.moe_configs is not None and not args.moe_configs.is_dir():
        p.error(f"--moe-configs {args.moe_configs}: not a folder")
    return args


def _batch_sizes(text: str) -> list[int]:
    """--decode-batches: comma-separated batch sizes, each at least 1."""
    if not all(b.strip().isdigit() and int(b) > 0 for b in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated batch sizes of at least 1")
    return [int(b) for b in text.split(",")]


def workload(args) -> Workload:
    w = Workload.tiny(args.samples or 4) if args.shape == "tiny" else Workload(samples=args.samples or 256)
    if args.max_num_batched_tokens:
        w.max_num_batched_tokens = args.max_num_batched_tokens
    if args.max_num_seqs:
        w.max_num_seqs = args.max_num_seqs
    if args.decode_batches:
        w.decode_batches = args.decode_batches
    return w


def _subprocess(argv: list[str], part: str, config_dir: Path, timeout_s: float) -> dict:
    """Runs one part in a fresh process (so each holds the GPU alone) and returns its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, str(COMMAND_LINE), *argv, "--part", part, "--config-dir", str(config_dir), "--out", str(out)]
    try:
        proc = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr or ""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"timed out after {timeout_s} s", "stderr_tail": tail[-3000:]}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    result = json.loads(out.read_text())
    out.unlink()
    return result


def main(argv=None) -> dict:
    """The command line of scripts/bench_engine.py: every part (or the one --part names); the result."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.part != "all" else logging.WARNING, stream=sys.stderr)
    w = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = args.config_dir or Path(tmp)
        if args.config_dir is None:
            write_config(args.shape, args.num_layers, config_dir)
        if args.part == "ours":
            result = bench_ours(args, w, config_dir)
        elif args.part == "baseline":
            result = bench_baseline(args, w, config_dir)
        else:
            result = {
                "shape": args.shape, "num_layers": args.num_layers or json.loads((config_dir / "config.json").read_text())
                ["text_config"]["num_hidden_layers"], "device": _device_name(args.device),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"), "workload": asdict(w),
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                         if k not in ("out", "part", "config_dir", "beside")},
            }
            for precision in args.precisions.split(","):
                bench_precision(args, argv, w, config_dir, precision, result)
            if not args.skip_baseline:
                if args.device.startswith("cuda"):
                    result["baseline"] = _subprocess(argv_without_out(argv), "baseline", config_dir / "bf16", args.part_timeout)
                else:
                    result["baseline"] = bench_baseline(args, w, config_dir / "bf16")
    text = json.dumps(result, indent=None if args.part != "all" else 1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.part == "all":
        print(text)
    return result


def bench_precision(args, argv: list[str], w: Workload, config_dir: Path, precision: str, result: dict) -> None:
    """Our engine's parts at one precision into result: once, or per mode of --mixed-step-graphs both (keys
    ..._eager_steps first) and of --layer-fusions both (keys ..._unfused first); on CUDA each in its own process."""
    weights, compute = PRECISIONS[precision]
    part_dir = config_dir / precision
    part_dir.mkdir(exist_ok=True)
    write_config(args.shape, args.num_layers, part_dir, weights)
    kv = "fp8" if weights.startswith("fp8") and args.fp8_kv_cache else "auto"
    graph_modes = ["off", "on"] if args.mixed_step_graphs == "both" else [args.mixed_step_graphs]
    fusion_modes = ["off", "on"] if args.layer_fusions == "both" else [args.layer_fusions]
    for graphs in graph_modes:
        for fusions in fusion_modes:
            key = "ours" if precision == "bf16" else f"ours_{precision.replace('-', '_')}"
            key += "_eager_steps" if graphs == "off" and len(graph_modes) > 1 else ""
            key += "_unfused" if fusions == "off" and len(fusion_modes) > 1 else ""
            if args.device.startswith("cuda"):
                part_argv = [*argv_without_out(argv), "--kv-cache-dtype", kv, "--fp8-compute", compute,
                             "--mixed-step-graphs", graphs, "--layer-fusions", fusions]
                result[key] = _subprocess(part_argv, "ours", part_dir, args.part_timeout)
                if args.out is not None:  # keep ours even if the baseline never finishes
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
            else:
                args.kv_cache_dtype, args.mixed_step_graphs, args.layer_fusions = kv, graphs, fusions
                result[key] = bench_ours(args, w, part_dir)


def argv_without_out(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        out.append(a)
    return out


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"
