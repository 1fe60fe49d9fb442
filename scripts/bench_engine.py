"""Engine speed on random weights of a real Qwen3-VL shape (no checkpoint on disk), with the transformers
baseline on the same workload; prints one JSON object (and writes it to --out).

Our engine and the baseline each hold a full copy of the weights, so on CUDA each runs in its own
subprocess, one after the other. `--shape tiny` is a CPU smoke mode with tiny dims.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PRESETS = {"30b-a3b": "qwen3-vl-30b-a3b", "235b-a22b": "qwen3-vl-235b-a22b", "tiny": "qwen3-vl-30b-a3b"}
NO_EOS = [-1]  # generation_config eos for the bench: every request runs to max_tokens

log = logging.getLogger("bench_engine")


@dataclass
class Workload:
    """What is measured; `tiny` shrinks every size so the CPU smoke mode takes seconds."""

    samples: int = 256
    image_size: int = 1024  # square JPEG side in pixels: 1024 -> 1,024 visual tokens
    text_tokens: int = 700
    output_tokens: int = 45
    prefill_requests: int = 32
    prefill_len: int = 2048
    decode_batches: list[int] = field(default_factory=lambda: [1, 64, 256])
    decode_context: int = 1024
    decode_steps: int = 32
    vision_images: int = 16  # images of 1024 patches (32 x 32) encoded in one batch
    vision_grid: int = 32
    baseline_batch: int = 64
    max_num_seqs: int = 512  # mlperf_configs/h200x1.yaml (256 before run32)
    max_num_batched_tokens: int = 8192

    @classmethod
    def tiny(cls, samples: int) -> Workload:
        return cls(
            samples=samples, image_size=128, text_tokens=32, output_tokens=4, prefill_requests=4, prefill_len=64,
            decode_batches=[1, 4], decode_context=32, decode_steps=3, vision_images=2, vision_grid=8,
            baseline_batch=samples, max_num_seqs=16, max_num_batched_tokens=512,
        )


# --precisions: name -> (the checkpoint's weights, engine.fp8_compute)
PRECISIONS = {"bf16": ("bf16", "auto"), "fp8": ("fp8", "auto"), "fp8-dequantized": ("fp8", "dequantize")}


def write_config(shape: str, num_layers: int | None, out_dir: Path, precision: str = "bf16") -> None:
    """config.json (+ side configs) of the shape; generation never stops at an EOS. precision "fp8": the
    quantization_config of the released FP8 checkpoints (128x128 blocks), so the random weights are FP8."""
    from workers.fp8_checkpoint import RELEASED_BLOCK, quantization_config
    from workers.tiny_checkpoint import TINY_OVERRIDES, released_config, write_side_configs

    overrides = dict(TINY_OVERRIDES["moe"]) if shape == "tiny" else {}
    if num_layers:
        overrides["text_config.num_hidden_layers"] = num_layers
    config = released_config(PRESETS[shape], overrides)
    if precision == "fp8":
        config["quantization_config"] = quantization_config(RELEASED_BLOCK, config["text_config"]["num_hidden_layers"], moe=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_side_configs(out_dir)
    gen_path = out_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update(eos_token_id=NO_EOS, do_sample=False)
    gen_path.write_text(json.dumps(gen))


class Sync:
    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def __call__(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


# ---- our engine ---------------------------------------------------------------------------------------


class GpuTimeSplit:
    """CUDA events around the vision tower and every step: GPU-side time of vision / prefill / decode."""

    def __init__(self, engine):
        import torch

        self.torch = torch
        self.cuda = engine.config.is_cuda
        self.steps: list[tuple[str, object, object]] = []
        self.vision: list[tuple[object, object]] = []
        self.images_per_encode: list[int] = []  # the vision tower's batch sizes (images per call)
        runner = engine.runner
        execute, encode = runner.execute, runner.vision.encode

        def timed_execute(out, *upcoming):
            kind = "decode" if all(c.num_tokens == 1 for c in out.chunks) else "prefill"
            start, end = self._event(), self._event()
            result = execute(out, *upcoming)
            end.record() if self.cuda else None
            self.steps.append((kind, start, end))
            return result

        def timed_encode(pixel_values, grid_thw):
            self.images_per_encode.append(int(grid_thw.shape[0]))
            start, end = self._event(), self._event()
            result = encode(pixel_values, grid_thw)
            end.record() if self.cuda else None
            self.vision.append((start, end))
            return result

        runner.execute, runner.vision.encode = timed_execute, timed_encode

    def _event(self):
        if not self.cuda:
            return None
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def reset(self) -> None:
        self.steps.clear()
        self.vision.clear()
        self.images_per_encode.clear()

    def encodes(self) -> dict[str, float]:
        """How the images went through the tower: calls, images in all, images per call (mean and max)."""
        n = self.images_per_encode
        return {"calls": len(n), "images": sum(n), "images_per_call_mean": round(sum(n) / max(1, len(n)), 2),
                "images_per_call_max": max(n, default=0)}

    def split(self, wall_s: float) -> dict[str, float]:
        if not self.cuda:
            return {}
        self.torch.cuda.synchronize()
        ms = lambda a, b: a.elapsed_time(b)  # noqa: E731
        vision = sum(ms(a, b) for a, b in self.vision) / 1e3
        prefill = sum(ms(a, b) for k, a, b in self.steps if k == "prefill") / 1e3 - vision
        decode = sum(ms(a, b) for k, a, b in self.steps if k == "decode") / 1e3
        return {
            "vision_s": round(vision, 3), "prefill_s": round(prefill, 3), "decode_s": round(decode, 3),
            "idle_s": round(wall_s - vision - prefill - decode, 3), "wall_s": round(wall_s, 3),
        }


def moe_layer_times(model) -> dict[str, float]:
    """Microseconds of one MoE layer (router + experts) replayed in a CUDA graph, per token count, for the
    fused Triton kernels and for the torch._grouped_mm path."""
    import torch

    from scripts.gpu_timing import graph_us
    from workers.model import moe

    mlp = next(layer.mlp for layer in model.language_model.layers if isinstance(layer.mlp, moe.SparseMoeBlock))
    hidden = mlp.gate.weight.shape[1]
    paths = {"fused": mlp.experts.forward, "grouped_mm": mlp.experts.grouped}
    times = {}
    for tokens in (1, 2, 64, 256, 8192):
        x = torch.randn(tokens, hidden, device="cuda", dtype=mlp.gate.weight.dtype)
        for path, experts in paths.items():
            times[f"{path}_T{tokens}"] = graph_us(lambda: experts(x, *mlp.gate(x)), calls=1, replays=20)
    return times


def profile_steps(engine, n: int, out: Path, label: str, host: bool = False) -> tuple[int, dict]:
    """Runs n engine steps under torch.profiler; appends its table to out; returns (tokens generated, {wall_ms,
    kernel_ms, busy}): kernel time over wall is how busy the GPU was across those steps (one stream, so kernels do
    not overlap). host: the host's ops are recorded too (slower steps) and the table is by host time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    generated = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host else [])]
    with profile(activities=activities) as prof:
        for _ in range(n):
            generated += sum(len(o.new_token_ids) for o in engine.step())
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    averages = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e3
    with out.open("a") as f:
        f.write(f"== {label}: {n} steps, wall {wall_ms:.1f} ms, kernels {kernel_ms:.1f} ms\n")
        sort_by = "self_cpu_time_total" if host else "self_cuda_time_total"
        f.write(averages.table(sort_by=sort_by, row_limit=40 if host else 30, max_name_column_width=70) + "\n")
    return generated, {"steps": n, "wall_ms": round(wall_ms, 1), "kernel_ms": round(kernel_ms, 1),
                       "busy": round(kernel_ms / wall_ms, 3)}


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's cudaMalloc / cudaFree calls and out-of-memory retries so far (each cudaFree and
    retry synchronises the device); {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def run_until_done(engine, sync) -> tuple[float, list[float]]:
    step_times = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        s = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - s)
    sync()
    return time.perf_counter() - t0, step_times


CATALOGUE_KEYS = {"fixed": "catalogue", "realistic": "catalogue_realistic"}


def catalogues(args, w: Workload) -> dict[str, list]:
    """The workloads named by --workloads, built before the engine (the realistic one tokenizes real prompts)."""
    from harness.catalogue_workload import build_workload

    return {kind: build_workload(kind, w.samples, w.image_size, w.text_tokens, w.output_tokens)
            for kind in args.workloads.split(",")}


# profiled windows (step index): while images are still prepared, the host's ops, after images are prepared
PROFILE_AT = {"preparing": 2, "host": 20, "prepared": 40}


def triton_cache_kernels() -> collections.Counter:
    """Kernels in Triton's on-disk cache by name (one .cubin per compiled specialisation): the difference over a run
    names what compiled inside it."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return collections.Counter(p.stem for p in root.glob("*/*.cubin")) if root.is_dir() else collections.Counter()


def run_catalogue(engine, requests: list, split: GpuTimeSplit | None, sync, profile_out: Path | None = None,
                  prepare_first: bool = False, prep_threads: int | None = None) -> dict:
    """Offline: every request arrives at once. Preparation (image decode, resize, patches) runs on a thread pool
    and each request joins the engine when ready, as in the worker (AsyncEngine); samples/s is from the first
    preparation to the last token. prepare_first: every request is prepared before the first step (the A/B for
    what overlapping costs the engine's steps); engine_wall_s is then from the first step. prep_threads: the size of
    the preparation pool (default: the engine's preprocess_threads, as the worker)."""
    from harness.catalogue_workload import describe
    from workers.types import SamplingParams

    allocator_before = allocator_counts()
    kernels_before = triton_cache_kernels()
    preemptions_before = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    prepared_s = engine_t0 = None
    generated = steps = 0
    profiles = {}
    with concurrent.futures.ThreadPoolExecutor(prep_threads or engine.config.preprocess_threads) as pool:
        pending = [pool.submit(engine.prepare_request, f"c{i}", r.prompt,
                               SamplingParams(temperature=0.0, max_tokens=r.output_tokens))
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


def bench_ours(args, w: Workload, checkpoint: Path) -> dict:
    import torch

    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.types import PromptInput, SamplingParams

    from harness.catalogue_workload import longest_request

    sync = Sync(args.device)
    if args.prefill_pointer_loads:
        from workers.model import paged_prefill

        paged_prefill.DEFAULT_TILES = paged_prefill.POINTER_TILES
    workloads = catalogues(args, w)
    max_model_len = max([4096] + [longest_request(r) for r in workloads.values()])
    cfg = EngineConfig(
        checkpoint=checkpoint, load_format="random", device=args.device, max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens, max_model_len=max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        encode_ahead=not args.no_encode_ahead, warm_up=not args.no_warm_up,
        num_kv_blocks=None if args.device.startswith("cuda") else 4096,
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}),
        fp8_compute=args.fp8_compute if args.device.startswith("cuda") else "fp8",
    )
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    sync()
    log.info("engine built in %.1f s", time.perf_counter() - t0)
    result: dict = {"engine_build_s": round(time.perf_counter() - t0, 2), "kv_blocks": engine.runner.num_kv_blocks,
                    "block_size": cfg.block_size, "kv_pool_tokens": engine.runner.num_kv_blocks * cfg.block_size,
                    "weights": engine.model_config.weight_format.label, "fp8_compute": cfg.fp8_compute, "kv_cache_dtype": args.kv_cache_dtype, "cuda_graphs": engine.runner.graphs is not None,
                    "preprocess_threads": cfg.preprocess_threads, "warm_up": engine.warm_up_report}
    rng = np.random.default_rng(1)
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n)  # noqa: E731
    counter = iter(range(10**9))

    def add_text(length: int, max_tokens: int) -> None:
        engine.add_request(f"r{next(counter)}", PromptInput(rng.integers(1000, 100000, length).tolist()), greedy(max_tokens))

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
        result[CATALOGUE_KEYS[kind]] = run_catalogue(engine, requests, split, sync, args.profile_out if kind == "fixed" else None)
        log.info("catalogue %s: %s", kind, result[CATALOGUE_KEYS[kind]])
    if "fixed" in workloads:  # the same requests again: what the overlap costs the steps, on a warm engine
        variants = {} if args.catalogue_only else {"catalogue_prepared_first": dict(prepare_first=True)}
        if args.overlap_ab:
            variants = {"catalogue_again": {}, **variants, "catalogue_16_prep_threads": dict(prep_threads=16)}
        variants.update({f"catalogue_run{n}": {} for n in range(2, args.repeat_fixed + 1)})
        for key, kwargs in variants.items():
            split.reset()
            result[key] = run_catalogue(engine, workloads["fixed"], split, sync, **kwargs)
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
    vision = engine.runner.vision
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
        result["moe_layer_us"] = moe_layer_times(engine.runner.model)

    # prefill throughput: text prompts, max_num_batched_tokens chunks, one sampled token each
    for _ in range(w.prefill_requests):
        add_text(w.prefill_len, 1)
    wall, steps = run_until_done(engine, sync)
    tokens = w.prefill_requests * w.prefill_len
    result["prefill_tokens_per_s"] = round(tokens / wall, 1)
    result["prefill_step_ms_median"] = round(statistics.median(steps) * 1e3, 2)
    log.info("vision and prefill done: %s", result)

    # decode throughput at fixed batch sizes and ~decode_context tokens of context
    decode = {}
    for batch in w.decode_batches:
        if batch > w.max_num_seqs:
            continue
        for _ in range(batch):
            add_text(w.decode_context, w.decode_steps + 2)
        while any(s.num_generated_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        sync()
        times = []
        for _ in range(w.decode_steps):
            s = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - s)
        run_until_done(engine, sync)
        step = statistics.median(times)
        decode[str(batch)] = {"step_ms_median": round(step * 1e3, 3), "tokens_per_s": round(batch / step, 1)}
        log.info("decode batch %d: %s", batch, decode[str(batch)])
    result["decode"] = decode
    return result


# ---- transformers baseline ------------------------------------------------------------------------------


def bench_baseline(args, w: Workload, checkpoint: Path) -> dict:
    import torch
    import transformers
    from PIL import Image
    from transformers import GenerationConfig
    from transformers.initialization import no_init_weights

    from workers.tiny_checkpoint import PREPROCESSOR_CONFIG
    from workers.weights import init_random_weights

    sync = Sync(args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hf_config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    with no_init_weights(), torch.device(args.device):
        model = transformers.Qwen3VLMoeForConditionalGeneration._from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    init_random_weights(model, seed=0)
    model.eval()
    result: dict = {"transformers": transformers.__version__, "experts_implementation":
                    getattr(model.config.text_config, "_experts_implementation", None)}
    proc_kwargs = {k: v for k, v in PREPROCESSOR_CONFIG.items() if k not in ("image_processor_type", "processor_class")}
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl_fast import Qwen2VLImageProcessorFast as proc_cls
        processor = proc_cls(**proc_kwargs)
    except ImportError:  # no torchvision (the CPU smoke mode)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as proc_cls
        processor = proc_cls(**proc_kwargs)
    result["image_processor"] = proc_cls.__name__
    from harness.catalogue_workload import fixed_catalogue
    from workers.tokenizer import IMAGE_PAD_ID

    prompts = [(r.prompt.token_ids, r.prompt.images[0])
               for r in fixed_catalogue(w.baseline_batch, w.image_size, w.text_tokens, w.output_tokens)]
    gen = dict(max_new_tokens=w.output_tokens, min_new_tokens=w.output_tokens, do_sample=False, pad_token_id=0)

    def generate(items) -> None:
        images = [Image.open(io.BytesIO(data)).convert("RGB") for _, data in items]
        processed = processor(images=images, return_tensors="pt")
        input_ids = torch.tensor([ids for ids, _ in items], device=args.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids),
                pixel_values=processed["pixel_values"].to(args.device, dtype),
                image_grid_thw=processed["image_grid_thw"].to(args.device),
                mm_token_type_ids=(input_ids == IMAGE_PAD_ID).int(), **gen,
            )
        assert out.shape[1] == input_ids.shape[1] + w.output_tokens

    generate(prompts[:2])  # warm-up
    sync()
    t0 = time.perf_counter()
    generate(prompts)
    sync()
    wall = time.perf_counter() - t0
    log.info("baseline generate: %.1f s for %d samples", wall, len(prompts))
    result["generate"] = {"batch": len(prompts), "wall_s": round(wall, 3), "samples_per_s": round(len(prompts) / wall, 3),
                          "note": "images through the transformers image processor, greedy, fixed output length"}
    try:
        # the same prompts with every <|image_pad|> replaced by a text token: same length, no image
        text_ids = [[1000 if t == IMAGE_PAD_ID else t for t in ids] for ids, _ in prompts]
        cb_config = GenerationConfig(max_new_tokens=w.output_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            outs = model.generate_batch(inputs=text_ids, generation_config=cb_config)
        sync()
        wall = time.perf_counter() - t0
        generated = sum(len(getattr(o, "generated_tokens", None) or []) for o in outs.values())
        if generated != len(text_ids) * w.output_tokens:  # no rate from a run that did not generate the tokens
            raise RuntimeError(f"generate_batch returned {generated} of {len(text_ids) * w.output_tokens} tokens "
                               f"({len(outs)} outputs)")
        result["generate_batch"] = {"requests": len(text_ids), "wall_s": round(wall, 3),
                                    "samples_per_s": round(len(text_ids) / wall, 3), "outputs": len(outs),
                                    "generated_tokens": generated, "expected_tokens": len(text_ids) * w.output_tokens,
                                    "note": "continuous batching API, text-only token ids of the same prompt length"}
    except Exception as exc:  # noqa: BLE001 - the baseline API differs across transformers versions
        result["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    if args.device.startswith("cuda"):
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


# ---- driver ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=sorted(PRESETS), default="30b-a3b")
    p.add_argument("--num-layers", type=int, default=None, help="fewer text layers for quick runs")
    p.add_argument("--samples", type=int, default=None, help="catalogue samples (default 256; tiny 4)")
    p.add_argument("--workloads", default=None, help="catalogue workloads, comma-separated: fixed (the issue's "
                   "one-image-size workload), realistic (synthetic catalogue with the real dataset's statistics); "
                   "default both, tiny: fixed")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's step budget (default 8192; "
                   "the prefill figure then runs steps of this many tokens)")
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
                   "fp8-dequantized (the FP8 checkpoint dequantized to bf16 at load: engine.fp8_compute dequantize)")
    p.add_argument("--fp8-kv-cache", action="store_true", help="the fp8 precision's run also stores the KV cache in FP8")
    p.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--fp8-compute", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--overlap-ab", action="store_true", help="the fixed catalogue also again (warm), and with 16 "
                   "preparation threads instead of the engine's preprocess_threads: what overlapping costs the steps")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (to measure their effect)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--part-timeout", type=float, default=1800, help="seconds each CUDA part may run")
    p.add_argument("--device", default=None, help="default: cuda, or cpu for --shape tiny")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile-out", type=Path, default=None, help="torch.profiler tables of the fixed catalogue's steps 2-3 (images still being prepared), 20-21 (host ops) and 40-41")
    p.add_argument("--part", choices=["all", "ours", "baseline"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--config-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.shape == "tiny" else "cuda"
    if args.workloads is None:
        args.workloads = "fixed" if args.shape == "tiny" else "fixed,realistic"
    from harness.catalogue_workload import WORKLOADS

    if set(args.precisions.split(",")) - set(PRECISIONS):
        p.error(f"--precisions: expected some of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; expected some of {list(WORKLOADS)}")
    return args


def workload(args) -> Workload:
    w = Workload.tiny(args.samples or 4) if args.shape == "tiny" else Workload(samples=args.samples or 256)
    if args.max_num_batched_tokens:
        w.max_num_batched_tokens = args.max_num_batched_tokens
    if args.max_num_seqs:
        w.max_num_seqs = args.max_num_seqs
    return w


def _subprocess(argv: list[str], part: str, config_dir: Path, timeout_s: float) -> dict:
    """Runs one part in a fresh process (so each holds the GPU alone) and returns its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, __file__, *argv, "--part", part, "--config-dir", str(config_dir), "--out", str(out)]
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
                         if k not in ("out", "part", "config_dir")},
            }
            for precision in args.precisions.split(","):
                key = "ours" if precision == "bf16" else f"ours_{precision.replace('-', '_')}"
                weights, compute = PRECISIONS[precision]
                part_dir = config_dir / precision
                part_dir.mkdir(exist_ok=True)
                write_config(args.shape, args.num_layers, part_dir, weights)
                kv = "fp8" if weights == "fp8" and args.fp8_kv_cache else "auto"
                if args.device.startswith("cuda"):
                    part_argv = [*argv_without_out(argv), "--kv-cache-dtype", kv, "--fp8-compute", compute]
                    result[key] = _subprocess(part_argv, "ours", part_dir, args.part_timeout)
                    if args.out is not None:  # keep ours even if the baseline never finishes
                        args.out.write_text(json.dumps(result, indent=1) + "\n")
                else:
                    args.kv_cache_dtype = kv
                    result[key] = bench_ours(args, w, part_dir)
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


if __name__ == "__main__":
    main()
