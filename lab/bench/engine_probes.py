"""Probes around an engine run for its benchmarks: CUDA events splitting GPU time into vision / prefill /
decode, torch.profiler windows, the CUDA allocator's and Triton's compile counters, one MoE layer's time."""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path



class Sync:
    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def __call__(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


class GpuTimeSplit:
    """CUDA events around the vision tower and every step: GPU-side time of vision / prefill / decode."""

    def __init__(self, engine):
        import torch

        self.torch = torch
        self.cuda = engine.config.is_cuda
        self.steps: list[tuple[str, object, object]] = []
        self.vision: list[tuple[object, object]] = []
        self.images_per_encode: list[int] = []  # the vision tower's batch sizes (images per call)
        runner = engine.executor
        launch, encode = runner.launch, runner.vision.encode

        def timed_launch(out, after=None):  # execute() launches too: every step's kernels lie between the events
            kind = "decode" if all(c.num_tokens == 1 for c in out.chunks) else "prefill"
            start, end = self._event(), self._event()
            result = launch(out, after)
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

        runner.launch, runner.vision.encode = timed_launch, timed_encode

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

    from lab.bench.gpu_timing import graph_us
    from workers.model import moe

    mlp = next(layer.mlp for layer in model.language_model.layers if isinstance(layer.mlp, moe.SparseMoeBlock))
    hidden = mlp.gate.weight.shape[1]
    # "fused": the engine's own path, the block's forward (the router's launch aligning the pairs for the tiled path;
    # FP8-dynamic experts: the grouped FP8 GEMMs from GROUPED_FP8_MIN_TOKENS). The bf16 torch._grouped_mm path beside
    # it; FP8 experts' grouped() is the float32 reference (it syncs: no graph, no figure)
    paths = {"fused": mlp}
    if mlp.experts.block is None:
        paths["grouped_mm"] = lambda x: mlp.experts.grouped(x, *mlp.gate(x))
    times = {}
    for tokens in (1, 2, 64, 256, 8192):
        x = torch.randn(tokens, hidden, device="cuda", dtype=mlp.gate.weight.dtype)
        for path, layer in paths.items():
            times[f"{path}_T{tokens}"] = graph_us(lambda: layer(x), calls=1, replays=20)
    return times


def profile_steps(engine, n: int, out: Path, label: str, host: bool = False) -> tuple[int, dict]:
    """Runs n engine steps under torch.profiler; appends its table to out; returns (tokens generated, {wall_ms,
    kernel_ms, busy, and per step launched in the window (with overlap, one more than n from an idle engine): kernels,
    copies, their busy time and the GPU's idle time between them, split at SHORT_GAP_US: timeline_per_step}): kernel
    time over wall is how busy the GPU was across those steps (one stream, so kernels do not overlap). host: the
    host's ops are recorded too (slower steps) and the table is by host time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    generated = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host else [])]
    # With overlap, a step launched before the window is applied in it, and the last call launches one more, which
    # the window's synchronize runs: the GPU's work per step is over the steps launched in the window.
    launched = n - engine.step_in_flight
    with profile(activities=activities) as prof:
        for _ in range(n):
            generated += sum(len(o.new_token_ids) for o in engine.step())
        launched += engine.step_in_flight
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    averages = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e3
    per_step = timeline_per_step(gpu_timeline(prof), launched)
    with out.open("a") as f:
        f.write(f"== {label}: {n} steps ({launched} launched in the window), wall {wall_ms:.1f} ms, kernels "
                f"{kernel_ms:.1f} ms; per step launched {per_step}\n")
        sort_by = "self_cpu_time_total" if host else "self_cuda_time_total"
        f.write(averages.table(sort_by=sort_by, row_limit=40 if host else 30, max_name_column_width=70) + "\n")
    return generated, {"steps": n, "launched": launched, "wall_ms": round(wall_ms, 1), "kernel_ms": round(kernel_ms, 1),
                       "busy": round(kernel_ms / wall_ms, 3), "per_step": per_step}


SHORT_GAP_US = 50.0  # idle the GPU spends between two queued kernels (launch latency) is shorter; waits for the host longer


def gpu_timeline(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU activity a torch.profiler run recorded (kernels, copies, fills; kernels
    replayed from CUDA graphs each count), in start order."""
    from torch.autograd import DeviceType

    ops = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sorted(ops, key=lambda op: op[1])


def timeline_per_step(ops: list[tuple[str, float, float]], steps: int, short_gap_us: float = SHORT_GAP_US) -> dict:
    """A profiled window of `steps` steps, per step: kernels (copies and fills counted apart), the GPU's busy
    milliseconds (activities merged where they overlap), and its idle milliseconds between one activity's end and
    the next one's start: gaps shorter than short_gap_us (between the kernels of a queued step) and longer ones (the
    GPU waiting for the host)."""
    copies = sum(1 for name, _, _ in ops if name.startswith(("Memcpy", "Memset")))
    busy = short = long = 0.0
    end = None
    for _, start, stop in ops:
        if end is not None and start > end:
            gap = start - end
            short, long = (short + gap, long) if gap < short_gap_us else (short, long + gap)
        busy += max(stop - max(start, end if end is not None else start), 0.0)
        end = stop if end is None else max(end, stop)
    per = max(steps, 1) * 1e3
    return {"kernels": round((len(ops) - copies) / max(steps, 1), 1), "copies": round(copies / max(steps, 1), 1),
            "busy_ms": round(busy / per, 3), "short_gaps_ms": round(short / per, 3), "long_gaps_ms": round(long / per, 3)}


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's cudaMalloc / cudaFree calls and out-of-memory retries so far (each cudaFree and
    retry synchronises the device); {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def prefill_steps(batch: int, context: int, budget: int) -> int:
    """At most how many steps batch prompts of context tokens take to prefill, each step's budget shared with the
    decodes of the requests prefilled before. The first of them decode in each of those steps, so a decode figure's
    requests keep that many tokens more than its timed steps need."""
    return -(-batch * context // max(1, budget - batch)) + 1


def check_decode_batch(engine, batch: int) -> None:
    """Every timed decode step must decode the whole batch: the time of fewer sequences is not batch's."""
    running = [s for s in engine.scheduler.running if s.num_generated_tokens > 0 and not s.is_finished]
    if len(running) != batch or engine.scheduler.waiting:
        raise RuntimeError(f"decode batch {batch}: {len(running)} sequences decoding and "
                           f"{len(engine.scheduler.waiting)} waiting at a timed step; the figure would not be batch's")


def abort_all(engine) -> None:
    """Ends every request still running or waiting (tokens a measurement kept in reserve and no longer needs)."""
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort(seq.request_id)


def run_until_done(engine, sync) -> tuple[float, list[float]]:
    step_times = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        s = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - s)
    sync()
    return time.perf_counter() - t0, step_times


def triton_cache_kernels() -> collections.Counter:
    """Kernels in Triton's on-disk cache by name (one .cubin per compiled specialisation): the difference over a run
    names what compiled inside it."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return collections.Counter(p.stem for p in root.glob("*/*.cubin")) if root.is_dir() else collections.Counter()
