"""Two-GPU layouts of one model on the catalogue workload (random weights of a real shape), side by side:
TP2, EP2, two data-parallel instances, and prefill/decode split with the KV moved GPU-to-GPU; plus the
235B-A22B shape at a few layers in TP2/EP2 for a per-layer figure. Prints one JSON object.

Per layout: Offline samples/s, then Poisson load (exponential gaps) at fractions of that rate, each request's
latency from arrival to its last token, and the highest rate tried whose p99 stays under 12 s / 1.5 s.
Each part runs in its own subprocess with its own timeout, so one failure costs only that part.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.bench.catalogue_workload import WORKLOADS, build_workload, describe
from lab.bench.engine_setup import Workload, write_config
from lab.bench.multi_gpu_instances import (COMMAND_LINE, SMOKE, base_argv, part_dp2, part_dp_instance, part_instance,
                                           part_l235, store_requests)
from lab.bench.multi_gpu_pd import part_pd

PARTS = ["tp2", "ep2", "dp2", "pd", "l235"]


def run_part(args, part: str, extra: list[str], config_dir: Path, timeout: float) -> dict:
    """One part in its own process session; on timeout the whole session (its rank processes too) is killed."""
    args.part_deadline = time.time() + timeout - 10  # the part's Poisson levels stop before its timeout
    cmd = [sys.executable, str(COMMAND_LINE), *base_argv(args), "--part", part, "--config-dir", str(config_dir), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": stderr[-2500:]}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftover rank processes of this part
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr_tail": stderr[-2500:]}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["part_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def extrapolate(l4: dict, l8: dict, lo: int, hi: int) -> dict:
    """Linear in layers: per-layer = (t(hi) - t(lo)) / (hi - lo); t(94) = t(lo) + (94 - lo) * per-layer."""
    per = lambda a, b: (b - a) / (hi - lo)  # noqa: E731
    d = {b: per(l4["decode_ms"][b], l8["decode_ms"][b]) for b in l4["decode_ms"]}
    cat = per(l4["catalogue"]["wall_s"], l8["catalogue"]["wall_s"])
    n = l4["catalogue"]["samples"]
    cat94 = l4["catalogue"]["wall_s"] + (94 - lo) * cat
    dec94 = {b: l4["decode_ms"][b] + (94 - lo) * d[b] for b in d}
    return {
        "label": "EXTRAPOLATION, not a measurement: linear in layers from two measured layer counts on 2 GPUs",
        "per_layer_decode_ms": {b: round(v, 3) for b, v in d.items()},
        "per_layer_catalogue_wall_s": round(cat, 4),
        "decode_ms_94_layers_2gpu": {b: round(v, 1) for b, v in dec94.items()},
        "catalogue_samples_per_s_94_layers_2gpu_if_it_fit": round(n / cat94, 3),
        "catalogue_samples_per_s_8gpu_two_tp4_instances_naive": round(2 * 2 * n / cat94, 3),
        "note": "94 layers of bf16 235B weights (470 GB) do not fit on 2 H200s; the 8-GPU figure assumes each TP4 "
                "instance runs a layer twice as fast as TP2 (per-GPU work halves, all-reduce cost ignored) — an upper bound",
    }


def run_l235(args, requests: list, tmp: Path, deadline: float, save) -> dict:
    """The 235B-A22B shape at each --layers-235b count, TP2 then EP2, each in its own process, and the
    extrapolation to 94 layers; save(partial) after each layout."""
    layers = [int(x) for x in args.layers_235b.split(",")]
    out: dict = {}
    for ep in (False, True):
        for n in layers:
            left = deadline - time.perf_counter()
            if left < 30:
                continue
            d = tmp / f"235b-{n}"
            if not d.exists():
                d.mkdir()
                write_config("tiny" if SMOKE else "235b-a22b", n, d)
                store_requests(d, requests[: args.samples_235b])
            extra = ["--layers", str(n), "--samples", str(args.samples_235b)] + (["--ep"] if ep else [])
            out[f"{'ep2' if ep else 'tp2'}_L{n}"] = run_part(args, "l235", extra, d, min(args.part_timeout, left))
        key = "ep2" if ep else "tp2"
        a, b = (out.get(f"{key}_L{n}", {}) for n in layers[:2])
        if len(layers) >= 2 and "decode_ms" in a and "decode_ms" in b:
            out[f"{key}_extrapolated"] = extrapolate(a, b, layers[0], layers[1])
        save(out)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """scripts/bench_multi_gpu.py's arguments (the hidden ones are a part's, in its own process)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--workload", choices=WORKLOADS, default="realistic",
                   help="catalogue requests: realistic (synthetic catalogue with the real dataset's statistics) or "
                        "fixed (the engine issue's 1024x1024 JPEG + 700 text tokens, 45 out)")
    p.add_argument("--samples-235b", type=int, default=64)
    p.add_argument("--layers-235b", default="4,8")
    p.add_argument("--decode", action="store_true", help="also decode step times at batch 64/256 (tp2/ep2)")
    p.add_argument("--part-timeout", type=float, default=240)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs in the TP/EP instances")
    p.add_argument("--budget-s", type=float, default=3600, help="wall seconds for all parts together")
    p.add_argument("--qps-fractions", default="0.5,0.7,0.85", help="Poisson levels as fractions of the offline rate")
    p.add_argument("--qps-requests", type=int, default=200, help="requests per Poisson level (at most)")
    p.add_argument("--qps-level-s", type=float, default=20, help="arrivals of one Poisson level stop after this")
    p.add_argument("--part-deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--ep", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """The command line of scripts/bench_multi_gpu.py: as a part's process (--part) that part's JSON on the last
    stdout line; else every --parts part in its own process, then one JSON object (also written to --out)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    w = Workload.tiny(args.samples) if SMOKE else Workload(samples=args.samples)
    if args.part is not None:  # a child process: one part, its JSON on the last stdout line
        parts = {"tp2": lambda: part_instance(args, args.config_dir, w, 2, False),
                 "ep2": lambda: part_instance(args, args.config_dir, w, 2, True),
                 "dp2": lambda: part_dp2(args, args.config_dir, w),
                 "dp-instance": lambda: part_dp_instance(args, args.config_dir, w),
                 "pd": lambda: part_pd(args, args.config_dir, w),
                 "l235": lambda: part_l235(args, args.config_dir, w)}
        print(json.dumps(parts[args.part]()), flush=True)
        return {}
    import torch

    deadline = time.perf_counter() + args.budget_s
    requests = build_workload(args.workload, w.samples, w.image_size, w.text_tokens, w.output_tokens)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                    "workload": {"kind": args.workload, **describe(requests)},
                    "args": {k: v for k, v in vars(args).items() if k not in ("out", "part", "config_dir")}}

    def save(l235: dict | None = None) -> None:
        if l235 is not None:  # the l235 part so far
            result["l235"] = l235
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        cfg30 = Path(tmp) / "30b"
        cfg30.mkdir()
        write_config("tiny" if SMOKE else "30b-a3b", None, cfg30)
        store_requests(cfg30, requests)
        for part in args.parts.split(","):
            left = deadline - time.perf_counter()
            if left < 30:
                result[part] = {"error": "skipped: device budget spent"}
                continue
            if part == "l235":
                result[part] = run_l235(args, requests, Path(tmp), deadline, save)
            else:
                result[part] = run_part(args, part, [], cfg30, min(args.part_timeout, left))
                left = deadline - time.perf_counter()
                if part in ("tp2", "ep2") and "error" in result[part] and not args.eager and left > 90:
                    result[part + "_eager_retry"] = run_part(args, part, ["--eager"], cfg30, min(args.part_timeout, left))
            save()
    print(json.dumps(result, indent=1))
    return result
