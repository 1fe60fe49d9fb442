"""SimulatedEngine: LLMEngine's interface and its real Scheduler/BlockManager, with no model: each step lasts what
the step model says (slept in real time, or reported for a virtual clock) and emits deterministic tokens.

Wrapped in workers.async_engine.AsyncEngine it serves WorkerServer like the real engine, so the real router and
harness can drive many simulated workers on one machine. Outputs end with EOS after `output_tokens` tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
import torch

from contract.tokenizer import EOS_TOKEN_IDS, IM_END_ID, token_runs
from contract.types import EngineLoad, FinishReason, PromptInput, RequestOutput, SamplingParams
from workers.block_manager import BlockManager
from workers.config import EngineConfig
from workers.encoder_cache import VisionCost
from workers.engine_api import PreparedRequest
from workers.kv_cache import KvExport
from workers.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from workers.sequence import Sequence
from workers.sim.config import SimulationConfig
from workers.sim.step_model import StepModel, StepWork
from workers.sim.trace import RequestTrace

VOCAB = 150_000  # generated ids stay below Qwen's special ids
# Qwen3-VL's vision tower (the same in the 30B-A3B and the 235B-A22B: depth 27, hidden 1152, MLP 4304, merge 2),
# costed as the real engine's scheduler costs it.
QWEN3_VL_VISION = VisionCost.of_tower(27, 1152, 4304, 2)


def next_token(context_len: int, salt: int) -> int:
    return (context_len * 104_729 + salt * 7919) % VOCAB


class SimulatedEngine:
    """One simulated engine instance. `realtime=False` never sleeps: a driver reads `last_step_s`."""

    def __init__(self, config: EngineConfig, sim: SimulationConfig, step_model: StepModel, *, realtime: bool = True,
                 vision: VisionCost = QWEN3_VL_VISION):
        self.config = config
        self.sim = sim
        self.step_model = step_model
        self.realtime = realtime
        blocks = config.num_kv_blocks or max(step_model.kv_capacity_tokens(config.gpu_memory_utilization)
                                             // config.block_size, 1)
        self.block_manager = BlockManager(blocks, config.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(
            SchedulerLimits.of(config, vision),
            self.block_manager, EOS_TOKEN_IDS,
        )
        self.generation_defaults = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=150)
        self.eos_token_ids = EOS_TOKEN_IDS
        self.last_step_s = 0.0
        self.busy_s = 0.0
        self.overrun_s = 0.0  # wall seconds steps ran past step_model x time_scale (a starved CPU, Python overhead)
        self._busy_until: float | None = None  # when the previous step ended with work left
        self._trace = RequestTrace(sim.trace_dir, f"{id(self):x}") if sim.trace_dir and realtime else None
        self._pending: list[RequestOutput] = []
        self._arrivals = itertools.count()
        self._steps = 0
        self.encoded_sizes: set[int] = set()  # image sizes (patches) encoded so far: the real tower's cuDNN plans

    # ---- admission (same contract as LLMEngine) ---------------------------------------------------

    def prepare_request(self, request_id: str, prompt: PromptInput, sampling: SamplingParams, *,
                        resume_token_ids: Seq[int] = (), prefill_only: bool = False,
                        kv_import: KvExport | None = None) -> PreparedRequest:
        if self._trace is not None:
            self._trace.enter(request_id, self.overrun_s)
        token_ids = list(prompt.token_ids) + list(resume_token_ids)
        num_prompt = len(prompt.token_ids)
        if len(token_ids) + (kv_import is not None) > self.config.max_model_len:
            return PreparedRequest(request_id, None, f"context of {len(token_ids)} tokens exceeds max_model_len "
                                   f"{self.config.max_model_len}", num_prompt)
        if kv_import is not None:
            if kv_import.num_tokens != len(token_ids):
                return PreparedRequest(request_id, None, f"imported KV covers {kv_import.num_tokens} tokens, the "
                                       f"prompt has {len(token_ids)}", num_prompt)
            if self.realtime and self.sim.model_kv_transfer:
                time.sleep(self.kv_transfer_s(kv_import.num_tokens) * self.sim.time_scale)
            token_ids.append(kv_import.first_token_id)
        sequence = Sequence(request_id=request_id, token_ids=token_ids, num_prompt_tokens=num_prompt,
                            sampling=sampling, arrival=-1, prefill_only=prefill_only, kv_import=kv_import,
                            image_spans=[(start, n, b"") for start, n in token_runs(prompt.token_ids)])
        return PreparedRequest(request_id, sequence, num_prompt_tokens=num_prompt)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        rid = prepared.request_id
        if self.scheduler.find(rid) is not None:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = prepared.sequence
        if seq is None:
            self._pending.append(RequestOutput(rid, [], True, FinishReason.ERROR, prepared.error,
                                               prepared.num_prompt_tokens))
            return
        if seq.sampling.max_tokens < 1 and not seq.prefill_only:
            self._pending.append(RequestOutput(rid, [], True, FinishReason.LENGTH, None, seq.num_prompt_tokens))
            return
        seq.arrival = next(self._arrivals)
        self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: PromptInput, sampling: SamplingParams, *,
                    resume_token_ids: Seq[int] = (), prefill_only: bool = False,
                    kv_import: KvExport | None = None) -> None:
        self.add_prepared(self.prepare_request(request_id, prompt, sampling, resume_token_ids=resume_token_ids,
                                               prefill_only=prefill_only, kv_import=kv_import))

    def kv_transfer_s(self, num_tokens: int) -> float:
        """One direction of NVLink for the request's KV cache."""
        hw = self.step_model.hardware
        return num_tokens * self.step_model.model.kv_bytes_per_token(self.sim.kv_dtype) / (hw.nvlink_gb_s / 2 * 1e9)

    # ---- control ---------------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        was_running = not seq.is_finished
        self.scheduler.abort(request_id)
        if was_running:
            self._pending.append(_output(seq))
        return True

    def export_kv(self, request_id: str, on_device: bool = False) -> KvExport:
        """A token-sized stand-in for the KV (the transfer's time is slept on the importing side; there is no
        device, so on_device changes nothing)."""
        seq = self.scheduler.held.get(request_id)
        if seq is None:
            raise KeyError(f"no finished prefill_only request {request_id!r} holds KV here")
        n = seq.num_tokens - 1
        keys = [torch.zeros(n, 1, 1, dtype=torch.float16)]
        return KvExport(num_tokens=n, first_token_id=seq.token_ids[-1], mrope_position_delta=0,
                        keys=keys, values=[k.clone() for k in keys])

    def release(self, request_id: str) -> bool:
        return self.scheduler.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def close(self) -> None:
        """Nothing to stop: no rank processes, no device (LLMEngine's close() stops its tensor-parallel ranks)."""

    def load(self) -> EngineLoad:
        s = self.scheduler
        queued = sum(seq.num_uncomputed_tokens for seq in s.waiting) + sum(
            max(0, seq.num_context_tokens - seq.num_computed_tokens) for seq in s.running)
        return EngineLoad(len(s.waiting), len(s.running), queued, self.block_manager.num_free_blocks,
                          self.block_manager.num_blocks, self._steps)

    # ---- the loop --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        outputs, self._pending = self._pending, []
        out = self.scheduler.schedule()
        changed = list(out.rejected)
        work = self.work(out)
        work.vision_plans = len(set(work.vision_patches) - self.encoded_sizes)
        self.encoded_sizes.update(work.vision_patches)
        self.last_step_s = self.step_model.step_ms(work) / 1e3
        self.busy_s += self.last_step_s
        if self.realtime:
            time.sleep(max(started + self.last_step_s * self.sim.time_scale - time.monotonic(), 0.0))
        if not out.is_empty:
            changed += self.scheduler.update(out, self._sample(out))
        if self.realtime:
            self._account_overrun(started)
        if self._trace is not None:
            for seq in changed:
                if seq.is_finished:
                    self._trace.leave(seq.request_id, self.overrun_s)
        outputs += [_output(seq) for seq in changed if self._hand_out(seq)]
        self._steps += 1
        return outputs

    def _hand_out(self, seq: Sequence) -> bool:
        """Stream this sequence's tokens now? Its first token, its end, and every stream_interval tokens."""
        unsent = seq.num_generated_tokens - seq.num_streamed_tokens
        return seq.is_finished or seq.num_streamed_tokens == 0 or unsent >= self.sim.stream_interval

    def _account_overrun(self, started: float) -> None:
        """Adds the step's wall time beyond its simulated length, and any gap since a previous busy step."""
        ended = time.monotonic()
        gap = started - self._busy_until if self._busy_until is not None else 0.0
        self.overrun_s += gap + max(ended - started - self.last_step_s * self.sim.time_scale, 0.0)
        self._busy_until = ended if self.scheduler.has_unfinished() else None

    @staticmethod
    def image_sizes(token_ids: Seq[int]) -> set[int]:
        """The pre-merge patches of each image of a prompt (the sizes encoded_sizes holds)."""
        return {length * 4 for _, length in token_runs(token_ids)}

    def work(self, out: SchedulerOutput) -> StepWork:
        """What the step model charges for a scheduled batch: its chunks, and the images the scheduler has the
        vision tower encode in it (now and ahead), as the real engine's runner carries them out."""
        work, depth = StepWork(num_seqs=len(out.chunks)), self.scheduler.limits.vision.depth
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
        encodes = (*out.encode_now, *out.encode_ahead)
        work.vision_patches = [encode.image.num_tokens * 4 for encode in encodes]
        work.vision_shares = [encode.num_blocks / depth if encode.num_blocks else 1.0 for encode in encodes]
        return work

    def _sample(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for chunk in out.chunks:
            seq = chunk.seq
            if not chunk.samples:
                continue
            done = seq.num_generated_tokens + 1 >= self.sim.output_tokens and not seq.prefill_only
            sampled[seq.request_id] = IM_END_ID if done else next_token(seq.num_tokens, seq.num_prompt_tokens)
        return sampled


def _output(seq: Sequence) -> RequestOutput:
    return RequestOutput(seq.request_id, seq.take_new_tokens(), seq.is_finished, seq.finish_reason, seq.error,
                         seq.num_prompt_tokens, seq.num_generated_tokens)


def build_step_model(hardware: str, sim: SimulationConfig, tp: int) -> StepModel:
    model = StepModel.build(hardware, sim.model, sim.weights, sim.kv_dtype, tp)
    return StepModel(model.calibration, model.hardware, model.model, sim.weights, sim.kv_dtype, tp,
                     sim.tp_efficiency, model.calibration_hardware)
