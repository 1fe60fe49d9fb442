"""What one scheduled step asks of the hardware, as counts (tensor-free): the simulated engine charges it through the
step model, and the real engine records it beside each step's measured time (workers/core/step_trace.py), so that
the step model can be fitted on the product path's own steps (lab/plan/step_fit.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from workers.core.scheduler import SchedulerOutput


@dataclass
class StepWork:
    """What one engine step computes."""

    num_seqs: int = 0                  # sequences in the step (prefill chunks + decodes)
    prefill_tokens: int = 0            # prompt tokens computed this step
    visual_prefill_tokens: int = 0     # of which image tokens
    decode_context_tokens: int = 0     # context read by the step's decoding sequences
    vision_patches: list[int] = field(default_factory=list)  # pre-merge patches of images encoded this step
    vision_shares: list[float] = field(default_factory=list)  # of each, the share of the tower's blocks run (1.0)
    vision_plans: int = 0              # of their image sizes, those the engine has not encoded before


@dataclass(frozen=True)
class StepPhases:
    """Where one engine step's wall time went, in seconds: scheduling, the executor's call (building and queueing the
    step, then `wait` of it blocked on the device's results), and the scheduler's update with the outputs. On a GPU
    the host's part, schedule + execute - wait + update, is the most the device can idle in a step. An overlapped
    step (EngineConfig.overlap_decode_steps) was scheduled and queued by the call before: its schedule is ~0, its
    execute holds scheduling and queueing the next step, which the device runs behind it, and its update puts its
    tokens in place."""

    schedule: float
    execute: float
    wait: float
    update: float

    @property
    def host(self) -> float:
        return self.schedule + self.execute - self.wait + self.update

    def ms(self) -> dict[str, float]:
        """The phases and the host's part in milliseconds (a step trace's "phases_ms")."""
        return {name: round(value * 1e3, 3) for name, value in (
            ("schedule", self.schedule), ("execute", self.execute), ("wait", self.wait), ("update", self.update),
            ("host", self.host))}


def median_phases_ms(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over some steps' StepPhases.ms() (or a step trace's phases_ms), in milliseconds (host:
    the median of the steps' host parts)."""
    return {name: round(statistics.median(step[name] for step in steps), 3) for name in steps[0]}


PATCHES_PER_VISUAL_TOKEN = 4  # Qwen3-VL merges 2 x 2 patches into one visual token


def step_work(out: SchedulerOutput, vision_depth: int, passes_beside: bool = False) -> StepWork:
    """The work of a scheduled batch: its chunks (prompt tokens, of which visual, and decodes' context), and the images
    the vision tower encodes within its time: the step before's encode_ahead (queued behind that step's sampling,
    so this step's kernels follow it) and its own encode_now, with the share of the tower's `vision_depth` blocks
    each runs (a pass spread over steps runs a few; passes_beside: a pass runs beside the steps, in none of their
    time). Its own encode_ahead runs after its tokens, in the next step's time. vision_plans is left to the caller
    (it needs history)."""
    work = StepWork(num_seqs=len(out.chunks))
    for chunk in out.chunks:
        seq = chunk.seq
        prompt_end = seq.num_context_tokens - (seq.kv_import is not None)
        prefill = max(min(chunk.start + chunk.num_tokens, prompt_end) - chunk.start, 0)
        if prefill == 0:
            work.decode_context_tokens += chunk.start
            continue
        work.prefill_tokens += prefill
        for image in seq.images:
            work.visual_prefill_tokens += max(min(image.end, chunk.start + prefill) - max(image.start, chunk.start), 0)
    encodes = out.encodes_in_step_time(passes_beside)
    work.vision_patches = [encode.image.num_tokens * PATCHES_PER_VISUAL_TOKEN for encode in encodes]
    work.vision_shares = [encode.num_blocks / vision_depth if encode.num_blocks else 1.0 for encode in encodes]
    return work
