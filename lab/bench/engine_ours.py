"""Our engine's part of the engine bench: the catalogue workloads offline (preparation overlapped with the
steps, or first), then the vision, MoE, prefill and decode figures (lab/bench/engine.py drives it)."""

from __future__ import annotations

import concurrent.futures
import logging
import statistics
import time
from pathlib import Path

import numpy as np

from lab.bench.engine_probes import (GpuTimeSplit, Sync, abort_all, allocator_counts, check_decode_batch,
                                     moe_layer_times, prefill_steps, profile_steps, run_until_done,
                                     triton_cache_kernels)
from lab.bench.engine_setup import Workload
from workers.core.step_work import median_phases_ms

log = logging.getLogger("bench_engine")


CATALOGUE_KEYS = {"fixed": "catalogue", "realistic": "catalogue_realistic"}
PROFILED_PREFILL_STEPS = 2  # --profile-prefill: full text-prefill steps profiled after the timed prefill part
PROFILED_DECODE_STEPS = 8  # --profile-decode: steps profiled after the timed ones, at the largest batch, twice


def catalogues(args, w: Workload) -> dict[str, list]:
    """The workloads named by --workloads, built before the engine (the realistic one tokenizes real prompts)."""
    from lab.bench.catalogue_workload import build_workload

    return {kind: build_workload(kind, w.samples, w.image_size, w.text_tokens, w.output_tokens)
            for kind in args.workloads.split(",") if kind}


# profiled windows (step index): while images are still prepared, the host's ops, after images are prepared
PROFILE_AT = {"preparing": 2, "host": 20, "prepared": 40}


def request_sampling(how: str, max_tokens: int):
    """A bench request's SamplingParams: greedy, or ("model-defaults") the released checkpoints'
    generation_config.json defaults, which the product path's requests ask for (use_model_defaults). The bench's
    own checkpoint is greedy with no end token (engine_setup.write_config), so every request runs to max_tokens."""
    from contract.types import SamplingParams
    from workers.tiny_checkpoint import GENERATION_CONFIG as released

    if how == "model-defaults":
        return SamplingParams(temperature=released["temperature"], top_p=released["top_p"], top_k=released["top_k"],
                              max_tokens=max_tokens)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def run_catalogue(engine, requests: list, split: GpuTimeSplit | None, sync, profile_out: Path | None = None,
                  prepare_first: bool = False, prep_threads: int | None = None, sampling: str = "greedy") -> dict:
    """Offline: every request arrives at once. Preparation (image decode, resize, patches) runs on a thread pool
    and each request joins the engine when ready, as in the worker (AsyncEngine); samples/s is from the first
    preparation to the last token. prepare_first: every request is prepared before the first step (the A/B for
    what overlapping costs the engine's steps); engine_wall_s is then from the first step. prep_threads: the size of
    the preparation pool (default: the engine's preprocess_threads, as the worker). sampling: request_sampling's."""
    from lab.bench.catalogue_workload import describe

    allocator_before = allocator_counts()
    kernels_before = triton_cache_kernels()
    preemptions_before = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    prepared_s = engine_t0 = None
    generated = steps = 0
    profiles = {}
    with concurrent.futures.ThreadPoolExecutor(prep_threads or engine.config.preprocess_threads) as pool:
        pending = [pool.submit(engine.prepare_request, f"c{i}", r.prompt,
                               request_sampling(sampling, r.output_tokens))
                   for i, r in enumerate(requests)]
        if prepare_first:
            concurrent.futures.wait(pending)
        while pending or engine.has_unfinished():
            ready = [f for f in pending if f.done()]
            for f in ready:
                p = f.result()
                if p.sequence is None:
                    raise RuntimeError(f"catalogue sample {p.request_id} rejected: {p.error}")
                engine.add_prepared(p)
            pending = [f for f in pending if f not in ready]
            if not pending and prepared_s is None:
                prepared_s = time.perf_counter() - t0
            if not engine.has_unfinished():
                concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                continue
            engine_t0 = engine_t0 or time.perf_counter()
            label = next((k for k, at in PROFILE_AT.items() if at == steps), None)
            if profile_out is not None and label is not None:
                n, profiles[label] = profile_steps(engine, 2, profile_out, f"{label} (step {steps})", host=label == "host")
                generated += n
                steps += 2
                continue
            generated += sum(len(o.new_token_ids) for o in engine.step())
            steps += 1
    sync()
    end = time.perf_counter()
    wall_s = end - t0
    expected = sum(r.output_tokens for r in requests)
    if generated != expected:
        raise RuntimeError(f"catalogue run generated {generated} tokens, expected {expected}")
    result = {
        **describe(requests), "preprocess_done_s": round(prepared_s, 3), "wall_s": round(wall_s, 3),
        "samples_per_s": round(len(requests) / wall_s, 3), "output_tokens_per_s": round(expected / wall_s, 1),
        "engine_wall_s": round(end - engine_t0, 3), "steps": steps,
        "preemptions": engine.scheduler.num_preemptions - preemptions_before,
    }
    if profiles:
        result["profiled_steps"] = profiles
    if allocator_before:
        result["cuda_allocator"] = {k: v - allocator_before[k] for k, v in allocator_counts().items()}
        result["triton_compiles"] = dict(triton_cache_kernels() - kernels_before)
    if split is not None:
        result["gpu_time_split"] = split.split(end - engine_t0 if prepare_first else wall_s)
        result["vision_encodes"] = split.encodes()
    return result


def kernel_options(args) -> None:
    """The kernel choices the command line makes, set before the engine is built: a MoE tile table read from another
    folder, the prefill attention's pointer loads, the layers' fused launches off (--layer-fusions off: the norms,
    activation quantisations and routing launched apart, for an A/B in one call)."""
    from workers.model import fused_moe, norm_quant, paged_prefill, route_align

    if args.moe_configs is not None:  # before the engine reads a table
        fused_moe.TUNED_DIR = Path(args.moe_configs)
    if args.prefill_pointer_loads:
        paged_prefill.DEFAULT_TILES = paged_prefill.POINTER_TILES
    norm_quant.FUSED = route_align.FUSED = args.layer_fusions != "off"


def bench_ours(args, w: Workload, checkpoint: Path) -> dict:
    import torch

    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from contract.types import PromptInput

    from lab.bench.catalogue_workload import longest_request

    sync = Sync(args.device)
    kernel_options(args)
    workloads = catalogues(args, w)
    max_model_len = max([4096] + [longest_request(r) for r in workloads.values()])
    if args.beside is not None:  # its decoding requests last through every measurement
        max_model_len = max(max_model_len, args.beside.context + args.beside.tokens_needed())
    cfg = EngineConfig(
        checkpoint=checkpoint, load_format="random", device=args.device, max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens, max_model_len=max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        mixed_step_graphs=args.mixed_step_graphs != "off",
        encode_ahead=not args.no_encode_ahead, warm_up=not args.no_warm_up, overlap_decode_steps=args.overlap_decode_steps,
        num_kv_blocks=None if args.device.startswith("cuda") else 4096,
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}),
        fp8_compute=args.fp8_compute if args.device.startswith("cuda") else "fp8",
    )
    t0 = time.perf_counter()
    engine = LLMEngine.from_config(cfg)
    sync()
    log.info("engine built in %.1f s", time.perf_counter() - t0)
    result: dict = {"engine_build_s": round(time.perf_counter() - t0, 2), "kv_blocks": engine.executor.num_kv_blocks,
                    "block_size": cfg.block_size, "kv_pool_tokens": engine.executor.num_kv_blocks * cfg.block_size,
                    "weights": engine.executor.model_config.weight_format.label, "fp8_compute": cfg.fp8_compute, "kv_cache_dtype": args.kv_cache_dtype, "cuda_graphs": engine.executor.graphs is not None,
                    "mixed_step_graphs": engine.executor.step_graphs is not None,
                    "preprocess_threads": cfg.preprocess_threads, "warm_up": engine.warm_up_report,
                    "moe_configs": str(args.moe_configs or "workers/model/fused_moe_configs"),
                    "overlap_decode_steps": cfg.overlap_decode_steps, "layer_fusions": args.layer_fusions != "off",
                    "sampling": args.sampling}
    rng = np.random.default_rng(1)
    counter = iter(range(10**9))

    def add_text(length: int, max_tokens: int) -> None:
        engine.add_request(f"r{next(counter)}", PromptInput(rng.integers(1000, 100000, length).tolist()),
                           request_sampling(args.sampling, max_tokens))

    # warm-up: one short prefill + decodes (compiles Triton kernels, cuBLAS handles)
    for _ in range(2):
        add_text(64, 4)
    run_until_done(engine, sync)

    if not args.catalogue_only:
        result.update(bench_parts(args, w, engine, sync, add_text))
    # catalogue workloads, offline: every sample arrives at once; preprocessing overlaps the engine's steps
    split = GpuTimeSplit(engine)
    for kind, requests in workloads.items():
        split.reset()
        result[CATALOGUE_KEYS[kind]] = run_catalogue(engine, requests, split, sync,
                                                     args.profile_out if kind == "fixed" else None, sampling=args.sampling)
        log.info("catalogue %s: %s", kind, result[CATALOGUE_KEYS[kind]])
    if "fixed" in workloads:  # the same requests again: what the overlap costs the steps, on a warm engine
        variants = {} if args.catalogue_only else {"catalogue_prepared_first": dict(prepare_first=True)}
        if args.overlap_ab:
            variants = {"catalogue_again": {}, **variants, "catalogue_16_prep_threads": dict(prep_threads=16)}
        variants.update({f"catalogue_run{n}": {} for n in range(2, args.repeat_fixed + 1)})
        for key, kwargs in variants.items():
            split.reset()
            result[key] = run_catalogue(engine, workloads["fixed"], split, sync, sampling=args.sampling, **kwargs)
            log.info("%s: %s", key, result[key])
    if args.device.startswith("cuda"):
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        free, total = torch.cuda.mem_get_info()
        result["device_memory_used_gib"] = round((total - free) / 2**30, 2)
    return result


def bench_parts(args, w: Workload, engine, sync, add_text) -> dict:
    """The vision tower, MoE layer, prefill and decode figures (everything but the catalogues)."""
    import torch

    result: dict = {}
    # vision tower, one batch of same-size images
    vision = engine.executor.vision
    g = w.vision_grid
    patches = torch.randn(w.vision_images * g * g, 1536)
    grid = torch.tensor([[1, g, g]] * w.vision_images)
    vision.encode(patches, grid)
    sync()
    times = []
    for _ in range(3):
        s = time.perf_counter()
        vision.encode(patches, grid)
        sync()
        times.append(time.perf_counter() - s)
    result["vision_ms_per_image"] = round(statistics.median(times) * 1e3 / w.vision_images, 3)
    result["vision_patches_per_image"] = g * g

    if args.device.startswith("cuda"):
        result["moe_layer_us"] = moe_layer_times(engine.executor.model)

    # prefill throughput: text prompts, max_num_batched_tokens chunks, one sampled token each
    for _ in range(w.prefill_requests):
        add_text(w.prefill_len, 1)
    wall, steps = run_until_done(engine, sync)
    tokens = w.prefill_requests * w.prefill_len
    result["prefill_tokens_per_s"] = round(tokens / wall, 1)
    result["prefill_step_ms_median"] = round(statistics.median(steps) * 1e3, 2)
    if args.profile_prefill:
        for _ in range(w.prefill_requests):
            add_text(w.prefill_len, 1)
        label = f"{engine.executor.model_config.weight_format.label}: text prefill, {w.prefill_len}-token prompts"
        result["prefill_profile"] = profile_steps(engine, PROFILED_PREFILL_STEPS, args.profile_prefill, label)[1]
        run_until_done(engine, sync)
    log.info("vision and prefill done: %s", result)

    # decode throughput at fixed batch sizes and ~decode_context tokens of context
    decode = {}
    batches = [b for b in w.decode_batches if b <= w.max_num_seqs]
    profiled = 2 * PROFILED_DECODE_STEPS if args.profile_decode else 0  # the GPU's kernels, then the host's ops
    for batch in batches:
        extra = profiled if batch == batches[-1] else 0
        # The prompts' prefill takes several steps, and the requests admitted first decode in each of them; so each
        # keeps enough tokens for those steps too, and every timed and profiled step decodes the whole batch.
        tokens = w.decode_steps + 2 + extra + prefill_steps(batch, w.decode_context, w.max_num_batched_tokens)
        for _ in range(batch):
            add_text(w.decode_context, tokens)
        while any(s.num_generated_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        sync()
        times, phases = [], []
        for _ in range(w.decode_steps):
            check_decode_batch(engine, batch)
            s = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - s)
            phases.append(engine.last_step_phases.ms())
        if extra:
            label = (f"{engine.executor.model_config.weight_format.label}, MoE tables {args.moe_configs or 'committed'}, layer "
                     f"fusions {args.layer_fusions}, overlap {engine.config.overlap_decode_steps}: decode batch {batch}")
            result["decode_profile"] = {
                str(batch): profile_steps(engine, PROFILED_DECODE_STEPS, args.profile_decode, label)[1],
                f"{batch}_host": profile_steps(engine, PROFILED_DECODE_STEPS, args.profile_decode, label + ", host ops",
                                               host=True)[1],
            }
        check_decode_batch(engine, batch)
        abort_all(engine)  # the tokens kept for the prefill's steps: not needed
        run_until_done(engine, sync)
        step = statistics.median(times)
        decode[str(batch)] = {"step_ms_median": round(step * 1e3, 3), "tokens_per_s": round(batch / step, 1),
                              "phases_ms_median": median_phases_ms(phases)}
        log.info("decode batch %d: %s", batch, decode[str(batch)])
    result["decode"] = decode
    if args.beside is not None:
        from lab.bench.tower_beside_decode import measure

        result["beside_tower"] = measure(engine, sync, add_text, args.beside)
        log.info("tower beside decode steps: %s", result["beside_tower"])
    return result
