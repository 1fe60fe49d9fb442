"""The parts of the multi-GPU bench (lab/bench/multi_gpu.py) that run one engine per process: TP2 / EP2
instances, the two data-parallel instances, the 235B-A22B shape at a few layers, and what they share
(the stored workload, engine config, warm-up, offline catalogue, Poisson levels)."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.bench.catalogue_workload import build_workload, longest_request
from lab.bench.engine_ours import run_catalogue
from lab.bench.engine_setup import Workload
from lab.bench.poisson_levels import P99_LIMITS_S, capped_arrivals, qps_search, summarize_levels
from workers.request_options import NO_OPTIONS, RequestOptions

REPO = Path(__file__).resolve().parents[2]
COMMAND_LINE = REPO / "scripts" / "bench_multi_gpu.py"  # each part runs as this command line with --part


SMOKE = os.environ.get("Q3VL_BENCH_SMOKE") == "1"  # CPU run of every part on tiny dims (checks the plumbing)


WORKLOAD_FILE = "workload.pkl"


def catalogue_requests(args, w: Workload) -> list:
    """The --workload requests: the driver builds them once and stores them beside each part's config
    (store_requests); a part reads them back."""
    import pickle

    path = args.config_dir / WORKLOAD_FILE if args.config_dir else None
    if path is not None and path.is_file():
        return pickle.loads(path.read_bytes())
    return build_workload(args.workload, w.samples, w.image_size, w.text_tokens, w.output_tokens)


def store_requests(config_dir: Path, requests: list) -> None:
    import pickle

    (config_dir / WORKLOAD_FILE).write_bytes(pickle.dumps(requests))


def engine_config(checkpoint: Path, device: str, w: Workload, requests: list, **kw):
    from workers.config import EngineConfig

    if SMOKE:
        device, kw["num_kv_blocks"] = "cpu", 2048
    return EngineConfig(checkpoint=checkpoint, load_format="random", device=device, max_num_seqs=w.max_num_seqs,
                        max_num_batched_tokens=w.max_num_batched_tokens,
                        max_model_len=max(4096, longest_request(requests)), **kw)


def sync_all() -> None:
    import torch

    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.synchronize(i)


def greedy(n: int):
    from contract.types import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def warm_up(engine) -> None:
    from contract.types import PromptInput

    for i in range(2):
        engine.add_request(f"warm{i}", PromptInput(list(range(1000, 1064))), greedy(4))
    while engine.has_unfinished():
        engine.step()


def prepare_all(engine, requests, prefix: str, options: RequestOptions = NO_OPTIONS) -> tuple[list, float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(engine.config.preprocess_threads) as pool:  # as the worker
        prepared = list(pool.map(
            lambda item: engine.prepare_request(f"{prefix}{item[0]}", item[1].prompt, greedy(item[1].output_tokens),
                                                options),
            enumerate(requests)))
    return prepared, time.perf_counter() - t0


def catalogue(engine, requests) -> dict:
    """Offline: all samples at once, preprocessing overlapping the steps (bench_engine.run_catalogue)."""
    return run_catalogue(engine, requests, None, sync_all)


def drive_poisson(engine, requests, arrivals: list[float], stop_s: float, tag: str, on_finished,
                  options: RequestOptions = NO_OPTIONS) -> int:
    """Adds request `tag`-n at arrivals[n] (preprocessing starts at arrival, on a pool of the engine's
    preprocess_threads, as in the AsyncEngine) and steps the engine; on_finished(rid, its arrival on
    time.monotonic()) as each one finishes.
    Stops stop_s after the start at the latest: the requests left are aborted, their count returned."""
    arrived: dict[str, float] = {}
    preparing: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(engine.config.preprocess_threads) as pool:
        t0, nxt = time.monotonic(), 0
        while nxt < len(arrivals) or preparing or engine.has_unfinished():
            now = time.monotonic() - t0
            if now > stop_s:
                break
            while nxt < len(arrivals) and arrivals[nxt] <= now:
                rid = f"{tag}-{nxt}"
                request = requests[nxt % len(requests)]
                arrived[rid] = t0 + arrivals[nxt]
                preparing.append(pool.submit(engine.prepare_request, rid, request.prompt,
                                             greedy(request.output_tokens), options))
                nxt += 1
            while preparing and preparing[0].done():
                engine.add_prepared(preparing.popleft().result())
            if engine.has_unfinished():
                for o in engine.step():
                    if o.finished:
                        on_finished(o.request_id, arrived.pop(o.request_id))
            else:
                time.sleep(0.001)
        for f in preparing:
            engine.add_prepared(f.result())
    for rid in list(arrived):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return len(arrived)


def poisson_latencies(engine, catalogue_requests: list, qps: float, requests: int, cap_s: float, seed: int,
                      tag: str) -> list[float]:
    """Requests arrive with exponential gaps at `qps` until cap_s; each one's seconds from arrival to its last
    token; a request not finished cap_s + 12 s after the start counts as infinitely late (and is aborted)."""
    latencies: list[float] = []
    late = drive_poisson(engine, catalogue_requests, capped_arrivals(qps, requests, cap_s, seed), cap_s + P99_LIMITS_S[0], tag,
                         lambda rid, arrived: latencies.append(time.monotonic() - arrived))
    return latencies + [math.inf] * late


def decode_steps(engine, batch: int, context: int, steps: int) -> float:
    """Median ms of a decode step at `batch` sequences of ~context tokens."""
    from contract.types import PromptInput

    from lab.bench.engine_probes import abort_all, check_decode_batch, prefill_steps

    tokens = steps + 2 + prefill_steps(batch, context, engine.config.max_num_batched_tokens)
    for i in range(batch):
        prompt = PromptInput([1000 + (i + j) % 5000 for j in range(context)])
        engine.add_request(f"d{batch}-{i}", prompt, greedy(tokens))
    while any(s.num_generated_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    sync_all()
    times = []
    for _ in range(steps):
        check_decode_batch(engine, batch)
        s = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - s)
    abort_all(engine)  # the tokens kept for the prefill's steps: not needed
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def prefill_rate(engine, requests: int, length: int) -> float:
    from contract.types import PromptInput

    for i in range(requests):
        engine.add_request(f"p{i}", PromptInput([1000 + (i * 7 + j) % 9000 for j in range(length)]), greedy(1))
    sync_all()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync_all()
    return requests * length / (time.perf_counter() - t0)


def base_argv(args) -> list[str]:
    flags = (["--decode"] if args.decode else []) + (["--eager"] if args.eager else [])
    return ["--samples", str(args.samples), "--workload", args.workload, "--part-timeout", str(args.part_timeout), "--qps-fractions", args.qps_fractions,
            "--qps-requests", str(args.qps_requests), "--qps-level-s", str(args.qps_level_s),
            "--part-deadline", str(args.part_deadline), *flags]


def part_instance(args, checkpoint: Path, w: Workload, tp: int, ep: bool) -> dict:
    from workers.engine import LLMEngine

    t0 = time.perf_counter()
    requests = catalogue_requests(args, w)
    engine = LLMEngine.from_config(engine_config(checkpoint, "cuda:0", w, requests, tensor_parallel_size=tp, expert_parallel=ep,
                                                 enforce_eager=args.eager))
    result = {"engine_build_s": round(time.perf_counter() - t0, 1), "kv_blocks": engine.executor.num_kv_blocks,
              "cuda_graphs": engine.executor.graphs is not None}
    try:
        warm_up(engine)
        result["catalogue"] = catalogue(engine, requests)
        measure = functools.partial(poisson_latencies, engine, requests)
        result["poisson"] = summarize_levels(qps_search(measure, result["catalogue"]["samples_per_s"], args)["levels"])
        if args.decode:
            result["decode_ms"] = {str(b): round(decode_steps(engine, b, w.decode_context, 16), 2) for b in w.decode_batches[1:]}
    finally:
        engine.close()
    return result


def part_dp_instance(args, checkpoint: Path, w: Workload) -> dict:
    """One of the two data-parallel instances (CUDA_VISIBLE_DEVICES picks its GPU); half the samples."""
    from workers.engine import LLMEngine

    requests = catalogue_requests(args, w)
    engine = LLMEngine.from_config(engine_config(checkpoint, "cuda:0", w, requests))
    warm_up(engine)
    requests = requests[args.shard :: 2]
    barrier = Path(args.barrier)  # both instances start the timed run together
    (barrier / f"ready{args.shard}").touch()
    while len(list(barrier.glob("ready*"))) < 2:
        time.sleep(0.05)
    result = catalogue(engine, requests)
    # its own Poisson stream at half the aggregate rate: two such streams are one at the full rate, routed at random
    result["poisson"] = qps_search(functools.partial(poisson_latencies, engine, requests), 2 * result["samples_per_s"],
                                   args, share=0.5)
    return result


def part_dp2(args, checkpoint: Path, w: Workload) -> dict:
    with tempfile.TemporaryDirectory() as barrier:
        procs = []
        for shard in (0, 1):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(shard))
            cmd = [sys.executable, str(COMMAND_LINE), *base_argv(args), "--part", "dp-instance", "--shard", str(shard),
                   "--barrier", barrier, "--config-dir", str(checkpoint)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=args.part_timeout) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"dp instance exit {p.returncode}: {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    merged = []
    for a, b in zip(results[0]["poisson"]["levels"], results[1]["poisson"]["levels"]):
        if "latencies_s" in a and "latencies_s" in b:
            merged.append({"fraction": a["fraction"], "qps": round(a["qps"] + b["qps"], 3), "requests": a["requests"] + b["requests"],
                           "latencies_s": a["latencies_s"] + b["latencies_s"]})
    for r in results:
        r.pop("poisson")
    return {"instances": results, "poisson": summarize_levels(merged),
            "samples_per_s": round(sum(r["samples"] for r in results) / max(r["wall_s"] for r in results), 3)}


def part_l235(args, checkpoint_root: Path, w: Workload) -> dict:
    """235B-A22B shape at args.layers layers, TP2 or EP2 (args.ep): decode step, prefill rate, catalogue."""
    from workers.engine import LLMEngine

    requests = catalogue_requests(args, w)
    engine = LLMEngine.from_config(engine_config(checkpoint_root, "cuda:0", w, requests, tensor_parallel_size=2,
                                                 expert_parallel=args.ep, enforce_eager=args.eager))
    try:
        warm_up(engine)
        out = {"layers": args.layers, "expert_parallel": args.ep,
               "decode_ms": {str(b): round(decode_steps(engine, b, w.decode_context, 12), 2) for b in w.decode_batches[1:]},
               "prefill_tokens_per_s": round(prefill_rate(engine, 8, 2048), 1)}
        out["catalogue"] = catalogue(engine, requests)
    finally:
        engine.close()
    return out
