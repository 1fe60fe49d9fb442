"""Two-GPU layouts of one model on the catalogue workload (random weights of a real shape), side by side:
TP2, EP2, two data-parallel instances, and prefill/decode split with the KV moved GPU-to-GPU; plus the
235B-A22B shape at a few layers in TP2/EP2 for a per-layer figure. Prints one JSON object.

Per layout: Offline samples/s, then Poisson load (exponential gaps) at fractions of that rate, each request's
latency from arrival to its last token, and the highest rate tried whose p99 stays under 12 s / 1.5 s.
Each part runs in its own subprocess with its own timeout, so one failure costs only that part.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.catalogue_workload import WORKLOADS, build_workload, describe, longest_request  # noqa: E402
from harness.engine_bench_ours import run_catalogue  # noqa: E402
from harness.engine_bench_setup import Workload, write_config  # noqa: E402
from workers.bench.poisson_levels import P99_LIMITS_S, capped_arrivals, qps_search, summarize_levels  # noqa: E402
from workers.stats import percentile  # noqa: E402

log = logging.getLogger("bench_multi_gpu")
PARTS = ["tp2", "ep2", "dp2", "pd", "l235"]


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
    from workers.types import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def warm_up(engine) -> None:
    from workers.types import PromptInput

    for i in range(2):
        engine.add_request(f"warm{i}", PromptInput(list(range(1000, 1064))), greedy(4))
    while engine.has_unfinished():
        engine.step()


def prepare_all(engine, requests, prefix: str, **kw) -> tuple[list, float]:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(engine.config.preprocess_threads) as pool:  # as the worker
        prepared = list(pool.map(
            lambda item: engine.prepare_request(f"{prefix}{item[0]}", item[1].prompt, greedy(item[1].output_tokens), **kw),
            enumerate(requests)))
    return prepared, time.perf_counter() - t0


def catalogue(engine, requests) -> dict:
    """Offline: all samples at once, preprocessing overlapping the steps (bench_engine.run_catalogue)."""
    return run_catalogue(engine, requests, None, sync_all)


def drive_poisson(engine, requests, arrivals: list[float], stop_s: float, tag: str, on_finished,
                  **prepare_kw) -> int:
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
                                             greedy(request.output_tokens), **prepare_kw))
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
    from workers.types import PromptInput

    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", PromptInput([1000 + (i + j) % 5000 for j in range(context)]), greedy(steps + 2))
    while any(s.num_generated_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    sync_all()
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - s)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


def prefill_rate(engine, requests: int, length: int) -> float:
    from workers.types import PromptInput

    for i in range(requests):
        engine.add_request(f"p{i}", PromptInput([1000 + (i * 7 + j) % 9000 for j in range(length)]), greedy(1))
    sync_all()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync_all()
    return requests * length / (time.perf_counter() - t0)


# ---- parts (each in its own process) ---------------------------------------------------------------------

def part_instance(args, checkpoint: Path, w: Workload, tp: int, ep: bool) -> dict:
    from workers.engine import LLMEngine

    t0 = time.perf_counter()
    requests = catalogue_requests(args, w)
    engine = LLMEngine(engine_config(checkpoint, "cuda:0", w, requests, tensor_parallel_size=tp, expert_parallel=ep,
                                     enforce_eager=args.eager))
    result = {"engine_build_s": round(time.perf_counter() - t0, 1), "kv_blocks": engine.runner.num_kv_blocks,
              "cuda_graphs": engine.runner.graphs is not None}
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
    engine = LLMEngine(engine_config(checkpoint, "cuda:0", w, requests))
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
            cmd = [sys.executable, __file__, *base_argv(args), "--part", "dp-instance", "--shard", str(shard),
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


def _pd_prefill(args, checkpoint: Path, w: Workload, port: int, pipe) -> None:
    """GPU 0: prefill_only requests; each finished one's KV goes to GPU 1 over NCCL, its handle down the pipe as
    ("kv", rid, prompt index, tokens, first token, hint, extra). Then the Poisson levels, driven from here."""
    from workers.engine import LLMEngine
    from workers.config import KvLinkConfig
    from workers.kv_transfer import KvLink

    requests = catalogue_requests(args, w)
    engine = LLMEngine(engine_config(checkpoint, "cuda:0", w, requests))
    link = KvLink(KvLinkConfig("127.0.0.1", port, "prefill", "cpu" if SMOKE else "cuda:0"))
    warm_up(engine)

    def hand_off(rid: str, index: int, wait: bool, **extra) -> tuple[float, int]:
        """(seconds, KV bytes); wait: until the decode GPU holds the KV (solo), else until the send is queued."""
        s = time.perf_counter()
        kv = engine.export_kv(rid, on_device=True)
        hint = link.send(kv)
        pipe.send(("kv", rid, index, kv.num_tokens, kv.first_token_id, hint, extra))
        if wait:
            link.flush()
        took = time.perf_counter() - s
        engine.release(rid)
        return took, 2 * kv.num_layers * kv.keys[0].numel() * kv.keys[0].element_size()

    def prefill_alone(rid: str) -> float:
        (prepared,), _ = prepare_all(engine, requests[:1], rid, prefill_only=True)
        sync_all()
        t0 = time.perf_counter()
        engine.add_prepared(prepared)
        while engine.has_unfinished():
            engine.step()
        sync_all()
        return time.perf_counter() - t0

    # One request alone, its prefill time against its hand-off time; the link's first transfer before it also
    # sets up the NCCL peer-to-peer connection, so it is reported on its own.
    prefill_alone("first")
    first, _ = hand_off("first0", 0, True)
    solo_prefill = prefill_alone("solo")
    solo, kv_bytes = hand_off("solo0", 0, True)
    pipe.send(("go",))  # the decode side drains these two; the timed run starts
    pipe.recv()
    handoffs: list[float] = []
    added: dict[str, float] = {}  # when each request was added, for its prefill time
    t0 = time.perf_counter()
    prepared, prepare_s = prepare_all(engine, requests, "c", prefill_only=True)
    for p in prepared:
        engine.add_prepared(p)
        added[p.request_id] = time.perf_counter()
    busy = 0.0
    while engine.has_unfinished():
        s = time.perf_counter()
        outs = engine.step()
        busy += time.perf_counter() - s
        for o in outs:
            if o.finished:
                prefill_s = time.perf_counter() - added[o.request_id]
                handoffs.append(hand_off(o.request_id, int(o.request_id[1:]), False, prefill_s=prefill_s)[0])
    link.flush()
    pipe.send(("offline_done", {
        "first_handoff_ms": round(first * 1e3, 3),
        "solo_prefill_ms": round(solo_prefill * 1e3, 2), "solo_handoff_ms": round(solo * 1e3, 3),
        "kv_bytes_per_request": kv_bytes, "solo_handoff_gb_per_s": round(kv_bytes / solo / 1e9, 2),
        "handoff_queue_ms_median": round(statistics.median(handoffs) * 1e3, 3),
        "handoff_queue_ms_p99": round(percentile(handoffs, 0.99) * 1e3, 3),
        "handoff_s_total": round(sum(handoffs), 3), "prefill_steps_s": round(busy, 3),
        "preprocess_s": round(prepare_s, 3), "prefill_wall_s": round(time.perf_counter() - t0, 3),
    }))
    _, offline_rate = pipe.recv()

    def measure(qps: float, count: int, cap_s: float, seed: int, tag: str) -> list[float]:
        """One Poisson level: arrivals and prefills here, each KV handed off as it is ready; the decode side
        returns the latencies (arrival here to last token there, one host clock)."""
        arrivals = capped_arrivals(qps, count, cap_s, seed)
        start = time.monotonic()
        drive_poisson(engine, requests, arrivals, cap_s + P99_LIMITS_S[0], tag,
                      lambda rid, arrived: hand_off(rid, int(rid.split("-")[1]) % len(requests), False, arrived=arrived),
                      prefill_only=True)
        pipe.send(("level", len(arrivals), start + cap_s + P99_LIMITS_S[0]))
        return pipe.recv()

    pipe.send(("done", summarize_levels(qps_search(measure, offline_rate, args)["levels"])))
    link.flush()


def _pd_decode(args, checkpoint: Path, w: Workload, port: int, pipe, result_pipe) -> None:
    """GPU 1: receives each request's KV from GPU 0 and decodes it: the offline run, then each Poisson level."""
    from workers.engine import LLMEngine
    from workers.config import KvLinkConfig
    from workers.kv_transfer import KvLink
    requests = catalogue_requests(args, w)
    engine = LLMEngine(engine_config(checkpoint, "cuda:0", w, requests))
    link = KvLink(KvLinkConfig("127.0.0.1", port, "decode", "cpu" if SMOKE else "cuda:0"))
    warm_up(engine)
    generated = 0
    finished_at: dict[str, float] = {}
    arrived: dict[str, float] = {}  # Poisson requests of the level: their arrival on GPU 0's side (one clock)
    per_request: list[tuple[float, float]] = []  # offline run: (prefill s from its add to its first token, hand-off s)

    def step() -> None:
        nonlocal generated
        for o in engine.step():
            generated += len(o.new_token_ids)
            if o.finished:
                finished_at[o.request_id] = time.monotonic()

    def serve() -> tuple:
        """Takes the hand-offs and decodes them until a control message comes (returned)."""
        while True:
            while pipe.poll(0 if engine.has_unfinished() else 0.01):
                msg = pipe.recv()
                if msg[0] != "kv":
                    return msg
                _, rid, index, n, first, hint, extra = msg
                kv = link.receive(hint, n, first)
                if "prefill_s" in extra:  # arrival on this GPU minus the send's start on the other
                    per_request.append((extra["prefill_s"], time.monotonic() - json.loads(hint)["sent_at"]))
                if "arrived" in extra:
                    arrived[rid] = extra["arrived"]
                request = requests[index]
                engine.add_request(rid, request.prompt, greedy(request.output_tokens - 1), kv_import=kv)
            if engine.has_unfinished():
                step()

    def drain(deadline: float = math.inf) -> None:
        """Decodes what is running until done or `deadline` (time.monotonic()); the rest is aborted."""
        while engine.has_unfinished() and time.monotonic() < deadline:
            step()
        for rid in arrived.keys() - finished_at.keys():
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()

    assert serve() == ("go",)
    drain()
    generated, t0 = 0, time.perf_counter()
    pipe.send(("started",))
    control, stats = serve()
    assert control == "offline_done", control
    drain()
    sync_all()
    wall = time.perf_counter() - t0
    expected = sum(r.output_tokens - 1 for r in requests)
    if generated != expected:
        raise RuntimeError(f"decode side generated {generated} tokens, expected {expected}")
    stats.update(decode_wall_s=round(wall, 3), samples=w.samples, samples_per_s=round(w.samples / wall, 3),
                 prefill_ms_median=round(statistics.median(p for p, _ in per_request) * 1e3, 2),
                 handoff_ms_median=round(statistics.median(h for _, h in per_request) * 1e3, 3),
                 handoff_ms_p99=round(percentile([h for _, h in per_request], 0.99) * 1e3, 3),
                 handoff_note="per request of the offline run: prefill = its add to its first token (queueing included "
                              "when all arrive at once); hand-off = export + send on GPU 0 until the KV is on GPU 1; "
                              "first_handoff_ms: the link's first transfer (NCCL peer-to-peer set-up included), "
                              "solo_handoff_ms: one request alone on the warm link",
                 poisson_note="arrivals and prefill on GPU 0, decode on GPU 1; latency from arrival to the last token")
    pipe.send(("rate", stats["samples_per_s"]))
    while (msg := serve())[0] == "level":
        _, count, deadline = msg
        drain(deadline)
        latencies = [finished_at[rid] - at for rid, at in arrived.items() if rid in finished_at]
        pipe.send(latencies + [math.inf] * (count - len(latencies)))
        arrived.clear()
    assert msg[0] == "done", msg
    stats["poisson"] = msg[1]
    link.close()
    result_pipe.send(stats)


def part_pd(args, checkpoint: Path, w: Workload) -> dict:
    import torch.multiprocessing as mp

    from workers.rank_group import _free_port

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results, result_end = ctx.Pipe()
    port = _free_port()
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    pre = ctx.Process(target=_pd_prefill, args=(args, checkpoint, w, port, a))
    pre.start()
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    dec = ctx.Process(target=_pd_decode, args=(args, checkpoint, w, port, b, result_end))
    dec.start()
    del os.environ["CUDA_VISIBLE_DEVICES"]
    dec.join(args.part_timeout)
    result = results.recv() if results.poll(5) else None
    pre.join(30)
    if result is None:
        raise RuntimeError(f"pd split produced no result (prefill exit {pre.exitcode}, decode exit {dec.exitcode})")
    return result


def part_l235(args, checkpoint_root: Path, w: Workload) -> dict:
    """235B-A22B shape at args.layers layers, TP2 or EP2 (args.ep): decode step, prefill rate, catalogue."""
    from workers.engine import LLMEngine

    requests = catalogue_requests(args, w)
    engine = LLMEngine(engine_config(checkpoint_root, "cuda:0", w, requests, tensor_parallel_size=2,
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


# ---- driver ----------------------------------------------------------------------------------------------

def base_argv(args) -> list[str]:
    flags = (["--decode"] if args.decode else []) + (["--eager"] if args.eager else [])
    return ["--samples", str(args.samples), "--workload", args.workload, "--part-timeout", str(args.part_timeout), "--qps-fractions", args.qps_fractions,
            "--qps-requests", str(args.qps_requests), "--qps-level-s", str(args.qps_level_s),
            "--part-deadline", str(args.part_deadline), *flags]


def run_part(args, part: str, extra: list[str], config_dir: Path, timeout: float) -> dict:
    """One part in its own process session; on timeout the whole session (its rank processes too) is killed."""
    args.part_deadline = time.time() + timeout - 10  # the part's Poisson levels stop before its timeout
    cmd = [sys.executable, __file__, *base_argv(args), "--part", part, "--config-dir", str(config_dir), *extra]
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


def main(argv=None) -> dict:
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
    args = p.parse_args(argv)
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

    def save() -> None:
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
                layers = [int(x) for x in args.layers_235b.split(",")]
                out: dict = {}
                for ep in (False, True):
                    for n in layers:
                        left = deadline - time.perf_counter()
                        if left < 30:
                            continue
                        d = Path(tmp) / f"235b-{n}"
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
                    result[part] = out
                    save()
            else:
                result[part] = run_part(args, part, [], cfg30, min(args.part_timeout, left))
                left = deadline - time.perf_counter()
                if part in ("tp2", "ep2") and "error" in result[part] and not args.eager and left > 90:
                    result[part + "_eager_retry"] = run_part(args, part, ["--eager"], cfg30, min(args.part_timeout, left))
            save()
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
