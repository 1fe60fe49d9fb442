"""The engine interfaces, written down: what WorkerServer serves and what AsyncEngine drives.

* EngineCore: the synchronous core, driven from one thread: requests in (prepare_request may run on other
  threads, add_prepared queues the result), step() runs one batch and returns what every request produced.
  LLMEngine (workers/engine.py) implements it, whatever its executor (LLMEngine.from_config: the checkpoint's model;
  workers.sim.engine.simulated: the step model's).
* Executor: what runs the batch the scheduler chose, behind LLMEngine (a StepLauncher also queues it without
  waiting; a TowerBeside also runs tower passes beside its steps). ModelRunner (workers/executor/model_runner.py: the
  model on one device or a tensor-parallel group) and SimulatedExecutor (workers/sim/engine.py: no model; each step
  lasts what the step model says of that batch, its images included) implement it. ModelFacts: what the engine
  knows of the model behind it.
* StepTimer: the clock LLMEngine's steps are timed on. WallTimer (workers/engine.py) for a model on a device,
  SimulatedTimer (workers/sim/engine.py) for the step model's.
* RequestInputs: what makes a request's Sequence before admission (validation, image decoding, positions).
  ModelInputs (workers/inputs/request_inputs.py) for a checkpoint's model, SimulatedInputs (workers/sim/engine.py) for
  a simulated one.
* ServingEngine: the asyncio side, one stream of outputs per request. AsyncEngine (workers/serve/async_engine.py, over
  any EngineCore) and InstantEngine (workers/sim/instant_engine.py: no model, for measuring the router) implement it.

tests/test_engine_interfaces.py checks every implementation against these, method by method.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from contract.types import EngineLoad, PromptInput, RequestOutput, SamplingParams
from workers.core.encoder_cache import ImageKey, VisionCost
from workers.request_options import NO_OPTIONS, RequestOptions

if TYPE_CHECKING:
    from workers.config import EngineConfig
    from workers.kv_cache import KvExport
    from workers.core.scheduler import SchedulerOutput
    from workers.core.sequence import Sequence


@dataclass
class PreparedRequest:
    """A request after the CPU work done before admission (image decoding, positions, validation).

    Either `sequence` is set, or `error` says why the request cannot be served."""

    request_id: str
    sequence: Sequence | None
    error: str | None = None
    num_prompt_tokens: int = 0
    # time.monotonic() seconds: when the request was handed to preparation (by the serving side, which may queue it
    # for a preparation thread; None: not known) and when its preparation began and ended (the step trace's)
    submitted: float | None = None
    prepare_started: float = 0.0
    prepare_ended: float = 0.0
    latency_bound_s: float = 0.0  # the request's bound from `submitted` (RequestOptions; 0: none): its deadline


@dataclass(frozen=True)
class ModelFacts:
    """What LLMEngine knows of the model behind its executor: the token ids that end a sequence, the sampling of
    requests that ask for the model's defaults (generation_config.json's), and how the scheduler costs its vision
    tower."""

    eos_token_ids: frozenset[int]
    generation_defaults: SamplingParams
    vision: VisionCost = VisionCost()


@runtime_checkable
class EngineCore(Protocol):
    """A continuous-batching engine core. step() never raises for a bad request: that request finishes with
    FinishReason.ERROR and a reason."""

    config: EngineConfig

    @property
    def generation_defaults(self) -> SamplingParams: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def prepare_request(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                        options: RequestOptions = NO_OPTIONS) -> PreparedRequest: ...

    def add_prepared(self, prepared: PreparedRequest) -> None: ...

    def add_request(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                    options: RequestOptions = NO_OPTIONS) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def export_kv(self, request_id: str, on_device: bool = False) -> KvExport: ...

    def release(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> EngineLoad: ...

    def close(self) -> None: ...


@runtime_checkable
class Executor(Protocol):
    """Runs the scheduler's batches for LLMEngine. num_kv_blocks: the KV pool it holds (the block manager's size).
    last_wait_s: how long the last execute() waited for the device's results (the sampled tokens' read-back): the
    rest of its time the host spent building and queueing the step (LLMEngine.last_step_phases)."""

    num_kv_blocks: int
    last_wait_s: float

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Runs one non-empty batch; returns the sampled token of every chunk that samples, by request id. May raise:
        the engine then fails that batch's requests, not itself."""
        ...

    def idle(self) -> None:
        """A step with nothing scheduled."""
        ...

    def release(self, request_id: str) -> None:
        """The request is gone (finished or aborted): drop whatever the executor holds for it."""
        ...

    def export_kv(self, seq: Sequence, on_device: bool = False) -> KvExport: ...

    def close(self) -> None: ...


@runtime_checkable
class LaunchedStep(Protocol):
    """A step queued on the device whose sampled tokens have not been read back yet."""

    request_ids: list[str]  # the sequences that sample in it, in the order of its samples
    waited_s: float  # how long wait() blocked

    def wait(self) -> dict[str, int]:
        """Blocks until the step's tokens are on the host; each sampling sequence's token by request id."""
        ...


@runtime_checkable
class StepLauncher(Protocol):
    """An executor that can queue a step without waiting for it, the next one's input tokens read on the device from a
    step still running (EngineConfig.overlap_decode_steps)."""

    @property
    def can_overlap(self) -> bool:
        """Whether launch may be given a step still running (a single-process engine)."""
        ...

    def launch(self, out: SchedulerOutput, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queues out (any step: prompt chunks, decodes, images, KV imports). after: the step still running whose
        samples some of out's input tokens are (workers.core.sequence.PENDING_TOKEN in token_ids: each such
        sequence is among after.request_ids); None: every input token is on the host."""
        ...


@runtime_checkable
class TowerBeside(Protocol):
    """An executor that can run tower passes beside its steps (EngineConfig.vision_green_sms): the scheduler lists a
    pass whole when it starts, and it is usable once the executor reports it done."""

    def finished_passes(self) -> list[ImageKey]:
        """The passes running beside the steps that finished since the last call."""
        ...

    def wait_passes(self) -> None:
        """Nothing else to run: blocks until the oldest pass running beside the steps is done."""
        ...


@runtime_checkable
class StepTimer(Protocol):
    """The clock an LLMEngine's steps are timed on, for the scheduler's StepClock (workers/core/slack.py)."""

    def began(self, started: float) -> None:
        """A step begins at `started` (time.monotonic())."""
        ...

    def seconds(self, started: float, ended: float) -> float:
        """How long the step that ran from `started` until its tokens were in place (`ended`) took."""
        ...

    def ended(self, started: float, busy: bool, outputs: list[RequestOutput]) -> None:
        """The step that began at `started` is over; busy: requests remain; outputs: those of the sequences it ran
        (not the admission errors and aborts it handed out)."""
        ...


@runtime_checkable
class RequestInputs(Protocol):
    """Makes a request's Sequence; raises workers.inputs.mm_inputs.PromptError naming what cannot be served."""

    def make_sequence(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                      options: RequestOptions) -> Sequence: ...


@runtime_checkable
class ServingEngine(Protocol):
    """An engine served over gRPC: generate() streams one request's outputs until one has finished=True, and
    leaving the stream early aborts the request."""

    @property
    def generation_defaults(self) -> SamplingParams: ...

    def generate(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                 options: RequestOptions = NO_OPTIONS) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def export_kv(self, request_id: str, on_device: bool = False) -> KvExport: ...

    async def release(self, request_id: str) -> bool: ...

    def load(self) -> EngineLoad: ...

    def shutdown(self) -> None: ...
