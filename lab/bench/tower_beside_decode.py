"""A vision-tower pass beside a text engine's decode steps: what each costs the other when both run at once.

Today a step's tower work runs in the step, before its text work (workers/executor/model_runner.py), so a large
image's pass stalls every decoding request for all of it, or, spread over steps, stretches each of their steps by its
share. Both kinds of work at once could do better only if they contend for different parts of the GPU: the tower's
attention is bound by the SMs' math and the decode step by memory and launch latency. This measures it on one engine:

- the tower alone on the engine's stream, and the decode steps alone (batch of `batch`, ~`context` tokens each);
- the tower on a second stream while the host runs decode steps until it is done: with all SMs shared (`0`), or the
  tower confined to a green context of N SMs (CUDA 12.8+'s SM partitioning, torch.cuda.green_contexts; the decode
  steps keep the whole GPU and so get at least the other SMs).

Each mode gives the tower's own GPU time, the decode steps' median and how many ran beside it, and over_serial:
the numbers a scheduler needs to decide whether a pass should run beside the decodes rather than in their steps.
The green contexts' API moved between torch releases; a mode this torch cannot run says why instead of a figure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from lab.bench.engine_probes import abort_all

PLAIN_STREAM = 0  # in `sms`: the tower on an ordinary second stream, every SM shared
EXTRA_TOKENS = 64  # tokens a decoding request keeps beyond the steps the measurements need


@dataclass(frozen=True)
class BesideTower:
    """What to measure: square images of `sides` patches a side (188: 35,344 patches, a 3,000 px image; 250:
    62,500, 4,000 px), each beside decode steps of `batch` requests at about `context` tokens, once per entry of
    `sms` (PLAIN_STREAM, or the SMs of the tower's green context)."""

    sides: tuple[int, ...]
    sms: tuple[int, ...]
    batch: int = 4
    context: int = 8192
    decode_steps: int = 32
    max_overlap_steps: int = 400  # decode steps a request can take beside one tower pass

    def __post_init__(self) -> None:
        if not self.sides or any(s < 2 or s % 2 for s in self.sides):
            raise ValueError(f"tower sides {self.sides}: even patch counts of at least 2 (the 2 x 2 patch merge)")
        if not self.sms or any(n < 0 for n in self.sms):
            raise ValueError(f"SM counts {self.sms}: 0 (a plain second stream) or a green context's SMs")
        if self.batch < 1 or self.context < 1:
            raise ValueError(f"batch {self.batch} and context {self.context} must be at least 1")

    def tokens_needed(self) -> int:
        """Tokens each decoding request generates to last through every measurement."""
        return self.decode_steps + len(self.sides) * len(self.sms) * self.max_overlap_steps + EXTRA_TOKENS

    @staticmethod
    def parse(sides: str, sms: str, batch: int, context: int) -> BesideTower:
        """From the command line's comma-separated lists. Raises ValueError naming what is wrong."""
        try:
            side_values = tuple(int(s) for s in sides.split(","))
            sm_values = tuple(int(s) for s in sms.split(","))
        except ValueError:
            raise ValueError(f"--beside-tower {sides!r} / --beside-sms {sms!r}: comma-separated integers") from None
        return BesideTower(side_values, sm_values, batch, context)


def tower_stream(num_sms: int, device):
    """The stream the tower runs on: an ordinary one (PLAIN_STREAM), or one of a green context of num_sms SMs
    (workers/executor/tower_stream.py, the engine's own), with the context (kept alive while the stream is used).
    Raises RuntimeError where this torch cannot."""
    import torch

    from workers.executor.tower_stream import green_stream

    if num_sms == PLAIN_STREAM:
        return torch.cuda.Stream(device), None
    return green_stream(num_sms, device)


def measure(engine, sync, add_text, spec: BesideTower) -> dict:
    """The figures of spec on `engine` (its decode steps as LLMEngine.step runs them, CUDA graphs included); leaves
    the engine without requests."""
    import torch

    vision = engine.executor.vision
    device = engine.executor.device
    c = vision.model.config
    in_features = c.in_channels * c.temporal_patch_size * c.patch_size**2
    for _ in range(spec.batch):
        add_text(spec.context, spec.tokens_needed())
    while any(s.num_generated_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    sync()
    result: dict = {"batch": spec.batch, "context": spec.context,
                    "decode_alone_ms": _median_ms([_timed_step(engine) for _ in range(spec.decode_steps)])}
    for side in spec.sides:
        pixels, grid = _image(vision, side, in_features, device)
        row: dict = {"patches": side * side}
        vision.encode(pixels, grid)  # plans, compiled kernels
        sync()
        row["tower_alone_ms"] = _median_ms([_timed_tower(vision, pixels, grid, torch.cuda.current_stream(device))
                                            for _ in range(3)])
        for num_sms in spec.sms:
            key = "plain_stream" if num_sms == PLAIN_STREAM else f"green_{num_sms}_sms"
            try:
                row[key] = _beside(engine, vision, pixels, grid, num_sms, device, spec.max_overlap_steps)
            except RuntimeError as exc:
                row[key] = {"error": str(exc)}
            else:
                row[key]["over_serial"] = over_serial(row[key]["wall_ms"], row["tower_alone_ms"],
                                                      row[key]["decode_steps"], result["decode_alone_ms"])
            sync()
        result[str(side)] = row
    abort_all(engine)
    while engine.has_unfinished():
        engine.step()
    sync()
    return result


def over_serial(wall_ms: float, tower_alone_ms: float, steps: int, step_alone_ms: float) -> float:
    """The time a pass and the decode steps beside it took together, over what the same work takes one after the
    other: the pass alone on every SM, then the steps at their time alone (below 1: running both at once pays)."""
    return round(wall_ms / (tower_alone_ms + steps * step_alone_ms), 3)


def _image(vision, side: int, in_features: int, device):
    import torch

    pixels = torch.randn(side * side, in_features, device=device, dtype=vision.dtype)
    return pixels, torch.tensor([[1, side, side]])


def _timed_step(engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def _timed_tower(vision, pixels, grid, stream) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        vision.encode(pixels, grid)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _beside(engine, vision, pixels, grid, num_sms: int, device, max_steps: int) -> dict:
    """One tower pass on its own stream while the host runs decode steps until it is done."""
    import torch

    stream, context = tower_stream(num_sms, device)
    alone = _timed_tower(vision, pixels, grid, stream)  # on this stream by itself: what its SMs give the tower
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_stream(torch.cuda.current_stream(device))
    queued = time.perf_counter()
    with torch.cuda.stream(stream):
        start.record(stream)
        vision.encode(pixels, grid)
        end.record(stream)
    enqueue_s = time.perf_counter() - queued
    steps = []
    while not end.query() and len(steps) < max_steps:
        steps.append(_timed_step(engine))
    end.synchronize()
    wall_s = time.perf_counter() - queued
    del context  # after its stream's work is done
    return {"tower_ms": round(start.elapsed_time(end), 2), "tower_alone_on_its_stream_ms": round(alone * 1e3, 2),
            "enqueue_ms": round(enqueue_s * 1e3, 2), "wall_ms": round(wall_s * 1e3, 2), "decode_steps": len(steps),
            "decode_median_ms": _median_ms(steps) if steps else None,
            "decode_steps_capped": len(steps) >= max_steps}


def _median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)
