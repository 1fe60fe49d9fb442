"""The prefill/decode split of the multi-GPU bench: prefill on GPU 0, decode on GPU 1, each request's KV moved
GPU-to-GPU (workers/serve/kv_transfer.py); the offline catalogue, then Poisson levels driven from the prefill side."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

from contract.stats import percentile
from lab.bench.engine_setup import Workload
from lab.bench.multi_gpu_instances import (SMOKE, catalogue_requests, drive_poisson, engine_config, greedy, prepare_all,
                                           sync_all, warm_up)
from lab.bench.poisson_levels import P99_LIMITS_S, capped_arrivals, qps_search, summarize_levels
from workers.request_options import RequestOptions

PREFILL_ONLY = RequestOptions(prefill_only=True)  # the prefill side's requests: each hands its KV to the decode side


def _prefill_catalogue(engine, requests, hand_off) -> tuple[list[float], float, float]:
    """The offline run's prefill side: every request prepared and added at once, each handed off as its prefill
    finishes; (hand-off seconds per request, preparation s, seconds inside engine steps)."""
    handoffs: list[float] = []
    added: dict[str, float] = {}  # when each request was added, for its prefill time
    prepared, prepare_s = prepare_all(engine, requests, "c", PREFILL_ONLY)
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
    return handoffs, prepare_s, busy


def _pd_prefill(args, checkpoint: Path, w: Workload, port: int, pipe) -> None:
    """GPU 0: prefill_only requests; each finished one's KV goes to GPU 1 over NCCL, its handle down the pipe as
    ("kv", rid, prompt index, tokens, first token, hint, extra). Then the Poisson levels, driven from here."""
    from workers.engine import LLMEngine
    from workers.config import KvLinkConfig
    from workers.serve.kv_transfer import KvLink

    requests = catalogue_requests(args, w)
    engine = LLMEngine.from_config(engine_config(checkpoint, "cuda:0", w, requests))
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
        (prepared,), _ = prepare_all(engine, requests[:1], rid, PREFILL_ONLY)
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
    t0 = time.perf_counter()
    handoffs, prepare_s, busy = _prefill_catalogue(engine, requests, hand_off)
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
                      PREFILL_ONLY)
        pipe.send(("level", len(arrivals), start + cap_s + P99_LIMITS_S[0]))
        return pipe.recv()

    pipe.send(("done", summarize_levels(qps_search(measure, offline_rate, args)["levels"])))
    link.flush()


def _pd_decode(args, checkpoint: Path, w: Workload, port: int, pipe, result_pipe) -> None:
    """GPU 1: receives each request's KV from GPU 0 and decodes it: the offline run, then each Poisson level."""
    from workers.engine import LLMEngine
    from workers.config import KvLinkConfig
    from workers.serve.kv_transfer import KvLink
    requests = catalogue_requests(args, w)
    engine = LLMEngine.from_config(engine_config(checkpoint, "cuda:0", w, requests))
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
                engine.add_request(rid, request.prompt, greedy(request.output_tokens - 1), RequestOptions(kv_import=kv))
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

    from lab.bench.router import free_port

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    results, result_end = ctx.Pipe()
    port = free_port()
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
