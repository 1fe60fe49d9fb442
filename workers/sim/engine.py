"""The simulated engine (simulated()): LLMEngine (its scheduler, block manager and request lifecycle) with no model
behind it. Its executor makes each step last what the step model says of the batch the real scheduler chose, images
included (slept in real time, or reported for a virtual clock), and emits deterministic tokens; its timer times the
engine's steps on the step model's clock.

Wrapped in workers.serve.async_engine.AsyncEngine it serves WorkerServer like the real engine, so the real router and
harness can drive many simulated workers on one machine. Outputs end with EOS after `output_tokens` tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from contract.tokenizer import EOS_TOKEN_IDS, IM_END_ID, token_runs
from contract.types import PromptInput, RequestOutput, SamplingParams
from workers.config import EngineConfig
from workers.core.encoder_cache import ImageKey, VisionCost
from workers.engine import LLMEngine
from workers.engine_api import ModelFacts
from workers.kv_cache import KvExport
from workers.request_options import RequestOptions
from workers.inputs.mm_inputs import PromptError
from workers.core.scheduler import SchedulerOutput
from workers.core.sequence import Sequence
from workers.sim.config import SimulationConfig
from workers.core.step_work import PATCHES_PER_VISUAL_TOKEN, StepWork, step_work
from workers.sim.step_model import StepModel
from workers.sim.trace import RequestTrace

VOCAB = 150_000  # generated ids stay below Qwen's special ids
# Qwen3-VL's vision tower (the same in the 30B-A3B and the 235B-A22B: depth 27, hidden 1152, MLP 4304, merge 2),
# costed as the real engine's scheduler costs it.
QWEN3_VL_VISION = VisionCost.of_tower(27, 1152, 4304, 2)
GENERATION_DEFAULTS = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=150)  # Qwen3-VL's release
# A tower pass beside the steps in a green context of s of the GPU's n SMs (engine.vision_green_sms), as an H100
# measured it (benchmarks/README.md, thirty-eighth and thirty-ninth passes, bench_engine.py --beside-tower): the pass
# takes n / s as long (64 SMs: 2.04x, 80: 1.64x, 96: 1.37x), a step's work beside it (n / (n - s))^0.6 as long
# (decode batches of 4 and 32: 1.39-1.49x at 64 SMs, 1.71-1.79x at 80, 2.2-2.3x at 96). Prompt chunks beside a pass
# were not measured: the same factor.
BESIDE_STEP_EXPONENT = 0.6


def next_token(context_len: int, salt: int) -> int:
    return (context_len * 104_729 + salt * 7919) % VOCAB


@dataclass
class SimulatedStep:
    """A simulated step launched and not yet waited for (workers/engine_api.LaunchedStep): its tokens were sampled at
    launch, as the device would; wait() charges its length (slept when realtime)."""

    executor: SimulatedExecutor
    work: StepWork
    sampled: dict[str, int]
    request_ids: list[str]
    passes: list[tuple[ImageKey, int]] = field(default_factory=list)  # those it starts beside the steps: patches
    waited_s: float = 0.0

    def wait(self) -> dict[str, int]:
        self.executor._run(self.work, self.passes)
        self.waited_s = self.executor.last_wait_s
        return self.sampled


class SimulatedExecutor:
    """The executor (workers/engine_api.Executor and StepLauncher) of a simulated engine: each step's length from the
    step model, slept when realtime (scaled by sim.time_scale), else only reported in last_step_s for a virtual clock.
    With engine.overlap_decode_steps the engine launches each step behind the one running, as the real engine does,
    so the simulation makes its decisions; the step's length is still charged whole (the host's share a real
    overlapped step hides is the step model's to calibrate). Its steps' lengths are SimulatedTimer's clock."""

    def __init__(self, config: EngineConfig, sim: SimulationConfig, step_model: StepModel, *, realtime: bool,
                 vision: VisionCost):
        self.sim = sim
        self.step_model = step_model
        self.realtime = realtime
        self.vision_depth = vision.depth
        self.num_kv_blocks = config.num_kv_blocks or max(
            step_model.kv_capacity_tokens(config.gpu_memory_utilization) // config.block_size, 1)
        self.last_step_s = 0.0
        self.last_wait_s = 0.0  # the Executor protocol: a realtime step's sleep stands for the device's time
        self.busy_s = 0.0
        self.step_started = time.monotonic()  # set by SimulatedTimer when a step begins: its sleep ends relative to it
        self.encoded_sizes: set[int] = set()  # image sizes (patches) encoded so far: the real tower's cuDNN plans
        self.beside = BesidePasses.of(config, step_model)  # engine.vision_green_sms on CUDA, else None
        self.now_s = 0.0  # the executor's own clock: its steps' lengths summed (where the passes beside them run)

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        return self.launch(out).wait()

    @property
    def can_overlap(self) -> bool:
        return True

    def launch(self, out: SchedulerOutput, after: SimulatedStep | None = None) -> SimulatedStep:
        """The step's tokens now (they depend on the sequences' lengths only, pending tokens counted), its length
        charged by wait()."""
        sampled = self._sample(out)
        passes = [(e.key, e.image.num_tokens * PATCHES_PER_VISUAL_TOKEN) for e in out.encode_now
                  if e.num_blocks and self.beside is not None]
        return SimulatedStep(self, self.work(out), sampled, list(sampled), passes)

    def idle(self) -> None:
        self._run(StepWork(num_seqs=0))

    def finished_passes(self) -> list[ImageKey]:
        """The TowerBeside protocol: passes beside the steps whose modelled end has passed on the executor's clock."""
        return self.beside.finished(self.now_s) if self.beside else []

    def wait_passes(self) -> None:
        """The TowerBeside protocol: the clock moves to the oldest pass's end (slept when realtime)."""
        self.last_step_s = max(self.beside.next_end() - self.now_s, 0.0) if self.beside else 0.0
        self.now_s += self.last_step_s
        self._sleep()

    def _run(self, work: StepWork, passes: list[tuple[ImageKey, int]] = ()) -> None:
        work.vision_plans = len(set(work.vision_patches) - self.encoded_sizes)
        self.encoded_sizes.update(work.vision_patches)
        alone_s = self.step_model.step_ms(work) / 1e3
        if self.beside is not None:
            for key, patches in passes:  # queued on the side stream at the step's start, one after another
                self.beside.start(key, self.step_model.vision_ms(patches) * self.step_model.correction.vision_scale
                                  / 1e3, self.now_s)
            alone_s = self.beside.stretch(alone_s, self.now_s)
        self.last_step_s = alone_s
        self.now_s += alone_s
        self.busy_s += self.last_step_s
        self._sleep()

    def _sleep(self) -> None:
        self.last_wait_s = 0.0
        if self.realtime:
            self.last_wait_s = max(self.step_started + self.last_step_s * self.sim.time_scale - time.monotonic(), 0.0)
            time.sleep(self.last_wait_s)

    def release(self, request_id: str) -> None:
        """Nothing is held per request."""

    def export_kv(self, seq: Sequence, on_device: bool = False) -> KvExport:
        """A token-sized stand-in for the KV (the transfer's time is slept on the importing side; there is no
        device, so on_device changes nothing)."""
        n = seq.num_tokens - 1
        keys = [torch.zeros(n, 1, 1, dtype=torch.float16)]
        return KvExport(num_tokens=n, first_token_id=seq.token_ids[-1], mrope_position_delta=0,
                        keys=keys, values=[k.clone() for k in keys])

    def close(self) -> None:
        """Nothing to stop: no rank processes, no device."""

    def kv_transfer_s(self, num_tokens: int) -> float:
        """One direction of NVLink for the request's KV cache."""
        hw = self.step_model.hardware
        return num_tokens * self.step_model.model.kv_bytes_per_token(self.sim.kv_dtype) / (hw.nvlink_gb_s / 2 * 1e9)

    def work(self, out: SchedulerOutput) -> StepWork:
        """What the step model charges for a scheduled batch: its chunks, and the images the scheduler has the
        vision tower encode in it (now and ahead), as the real engine's runner carries them out (passes beside the
        steps apart)."""
        return step_work(out, self.vision_depth, self.beside is not None)

    def _sample(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for chunk in out.chunks:
            seq = chunk.seq
            if not chunk.samples:
                continue
            done = seq.num_generated_tokens + 1 >= self.sim.output_tokens and not seq.prefill_only
            sampled[seq.request_id] = IM_END_ID if done else next_token(seq.num_tokens, seq.num_prompt_tokens)
        return sampled


class BesidePasses:
    """The passes a simulated engine runs beside its steps (engine.vision_green_sms), one after another as a stream
    runs them, on the executor's clock: each takes tower_factor times its time alone, and a step's work while one
    runs step_factor times its own (BESIDE_STEP_EXPONENT)."""

    def __init__(self, sms: int, total_sms: int):
        if not 0 < sms < total_sms:
            raise ValueError(f"engine.vision_green_sms {sms}: between 0 and the GPU's {total_sms} SMs")
        self.tower_factor = total_sms / sms
        self.step_factor = (total_sms / (total_sms - sms)) ** BESIDE_STEP_EXPONENT
        self.busy_until = 0.0
        self._ends: dict[ImageKey, float] = {}

    @classmethod
    def of(cls, config: EngineConfig, step_model: StepModel) -> BesidePasses | None:
        if not (config.vision_green_sms and config.is_cuda):
            return None
        total = step_model.hardware.sms
        if total is None:
            raise ValueError(f"engine.vision_green_sms: hardware profile {step_model.hardware.name!r} gives no SM "
                             "count (sms)")
        return cls(config.vision_green_sms, total)

    def start(self, key: ImageKey, alone_s: float, now: float) -> None:
        self.busy_until = max(self.busy_until, now) + alone_s * self.tower_factor
        self._ends[key] = self.busy_until

    def stretch(self, alone_s: float, now: float) -> float:
        """How long a step of alone_s seconds' work takes from `now`, slowed while a pass runs beside it."""
        beside_s = max(self.busy_until - now, 0.0)
        if alone_s * self.step_factor <= beside_s:
            return alone_s * self.step_factor
        return beside_s + alone_s - beside_s / self.step_factor

    def finished(self, now: float) -> list[ImageKey]:
        done = [key for key, end in self._ends.items() if end <= now + 1e-12]
        for key in done:
            del self._ends[key]
        return done

    def next_end(self) -> float:
        return min(self._ends.values(), default=0.0)


class SimulatedTimer:
    """The simulated engine's StepTimer (workers/engine_api.py): a step lasts what the step model says (the executor
    sleeps it out from the step's beginning when realtime). A realtime step's wall time beyond that is overrun (a
    starved CPU, Python overhead), which the request trace, if any, records per request."""

    def __init__(self, executor: SimulatedExecutor, trace: RequestTrace | None):
        self.executor = executor
        self.trace = trace
        self.overrun_s = 0.0  # wall seconds steps ran past step_model x time_scale
        self._busy_until: float | None = None  # when the previous step ended with work left

    def began(self, started: float) -> None:
        self.executor.step_started = started

    def seconds(self, started: float, ended: float) -> float:
        """The step model's time for the step (what realtime sleeps, and a virtual clock advances by)."""
        return self.executor.last_step_s

    def ended(self, started: float, busy: bool, outputs: list[RequestOutput]) -> None:
        if self.executor.realtime:
            self._account_overrun(started, busy)
        if self.trace is not None:
            for o in outputs:
                if o.finished:
                    self.trace.leave(o.request_id, self.overrun_s)

    def entered(self, request_id: str) -> None:
        """A request was received: its trace line starts."""
        if self.trace is not None:
            self.trace.enter(request_id, self.overrun_s)

    def _account_overrun(self, started: float, busy: bool) -> None:
        """Adds the step's wall time beyond its simulated length, and any gap since a previous busy step."""
        ended = time.monotonic()
        gap = started - self._busy_until if self._busy_until is not None else 0.0
        self.overrun_s += gap + max(ended - started - self.executor.last_step_s * self.executor.sim.time_scale, 0.0)
        self._busy_until = ended if busy else None


class SimulatedInputs:
    """A simulated request's Sequence (workers/engine_api.RequestInputs): its token ids, the image runs of its
    prompt (no pixels), an imported KV's transfer time slept when realtime."""

    def __init__(self, config: EngineConfig, executor: SimulatedExecutor, timer: SimulatedTimer):
        self.config = config
        self.executor = executor
        self.timer = timer

    def make_sequence(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                      options: RequestOptions) -> Sequence:
        self.timer.entered(request_id)
        token_ids, kv_import = list(prompt.token_ids) + list(options.resume_token_ids), options.kv_import
        if len(token_ids) + (kv_import is not None) > self.config.max_model_len:
            raise PromptError(f"context of {len(token_ids)} tokens exceeds max_model_len {self.config.max_model_len}")
        if kv_import is not None:
            if kv_import.num_tokens != len(token_ids):
                raise PromptError(f"imported KV covers {kv_import.num_tokens} tokens, the prompt has {len(token_ids)}")
            ex = self.executor
            if ex.realtime and ex.sim.model_kv_transfer:
                time.sleep(ex.kv_transfer_s(kv_import.num_tokens) * ex.sim.time_scale)
            token_ids.append(kv_import.first_token_id)
        return Sequence(request_id=request_id, token_ids=token_ids, num_prompt_tokens=len(prompt.token_ids),
                        sampling=sampling, arrival=-1, prefill_only=options.prefill_only, kv_import=kv_import,
                        image_spans=[(start, n, b"") for start, n in token_runs(prompt.token_ids)])


def simulated(config: EngineConfig, sim: SimulationConfig, step_model: StepModel, *, realtime: bool = True,
              vision: VisionCost = QWEN3_VL_VISION) -> LLMEngine:
    """One simulated engine instance: an LLMEngine on a SimulatedExecutor, timed by a SimulatedTimer. realtime=False
    never sleeps: a driver reads engine.executor.last_step_s. Outputs stream every sim.stream_interval tokens. Its
    prompts' images have no content to key a prefix cache on: it caches no prefixes."""
    executor = SimulatedExecutor(config, sim, step_model, realtime=realtime, vision=vision)
    trace = RequestTrace(sim.trace_dir, f"{id(executor):x}") if sim.trace_dir and realtime else None
    timer = SimulatedTimer(executor, trace)
    return LLMEngine(config.model_copy(update={"enable_prefix_caching": False}), executor,
                     SimulatedInputs(config, executor, timer), ModelFacts(EOS_TOKEN_IDS, GENERATION_DEFAULTS, vision),
                     stream_interval=sim.stream_interval, timer=timer)


def image_sizes(token_ids: Seq[int]) -> set[int]:
    """The pre-merge patches of each image of a prompt (the sizes SimulatedExecutor.encoded_sizes holds)."""
    return {length * 4 for _, length in token_runs(token_ids)}


def build_step_model(hardware: str, sim: SimulationConfig, tp: int, vision_split: bool = False) -> StepModel:
    """vision_split: EngineConfig.vision_tensor_parallel (the tower shared by the tp ranks, else whole on one)."""
    model = StepModel.build(hardware, sim.model, sim.weights, sim.kv_dtype, tp)
    return StepModel(model.calibration, model.hardware, model.model, sim.weights, sim.kv_dtype, tp,
                     sim.tp_efficiency, model.calibration_hardware, vision_split=vision_split)
