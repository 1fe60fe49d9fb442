"""ModelRunner: the only part of the engine that holds tensors and devices.

Loads the model and the KV pool, turns a SchedulerOutput into a flat batch (positions, slot mapping,
block tables, visual rows), runs the vision tower and the text tower, and samples the next tokens.
In a multi-GPU instance there is one runner per rank: rank 0's prepares each step, sends it to the
others (workers/executor/rank_group.py) and samples; every rank runs the text tower on its shard, and with
EngineConfig.vision_tensor_parallel its shard of every vision-tower call too (rank 0 keeps the outputs).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from workers.core.block_manager import cdiv
from workers.config import CPU_DEFAULT_KV_BLOCKS, EngineConfig
from workers.host_copy import HostCopy, QueuedWork, to_device
from workers.kv_cache import KvCache, KvExport, cache_dtype
from workers.inputs.image_processing import merge_block_patches, normalise_patches
from workers.executor.decode_graphs import MAX_GRAPH_BATCH, DecodeGraphs, StepBatch, full_budget_batch
from workers.executor.step_graphs import MixedStepGraphs, step_graph_sizes
from workers.executor.tower_stream import TowerStream
from workers.model import fused_moe
from workers.inputs.mm_inputs import MultiModalInput
from workers.model.moe import SparseMoeBlock
from workers.model.text import Qwen3VLTextForEngine, VisualRows
from workers.model.vision import TowerState, VisionEncoder, check_vision_split
from workers.model.vision_attention import warm_up_kernel
from workers.parallel import TensorParallel
from workers.executor.rank_group import PassBlocks, RankGroup, StepInputs, TowerWork
from workers.sampler import Sampler
from workers.core.encoder_cache import ImageKey
from workers.core.scheduler import ImageEncode, ScheduledChunk, SchedulerOutput
from workers.core.sequence import PENDING_TOKEN, Sequence
from workers.model_config import ModelConfig
from workers.weights import (
    init_random_fp8_weights, init_random_weights, load_kv_scales, load_text_weights, text_precision, vision_module,
)

log = logging.getLogger(__name__)


def build_text_model(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None = None
):
    """The text tower (this rank's shard) with checkpoint weights, allocated once on the target device in the
    target dtype. An FP8 checkpoint's linears keep FP8 weights on CUDA (W8A8 GEMMs); on the CPU, as transformers
    does there, they are dequantized at load into the activation dtype."""
    fmt = model_config.weight_format
    fp8_compute = fmt.is_fp8 and (device.type == "cuda" or config.fp8_compute == "fp8")
    if config.fp8_compute == "dequantize":
        fp8_compute = False
    precision = text_precision(config.checkpoint, fmt, config.load_format) if fp8_compute else None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3VLTextForEngine(model_config.text, tp, *([precision] if precision else []))
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if config.load_format == "random":
        init_random_weights(model, config.seed)
        init_random_fp8_weights(model, config.seed)
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.language_model.embed_tokens.weight
    else:
        load_text_weights(model, config.checkpoint, model_config.tie_word_embeddings, dtype, tp, fmt)
    model.finish_loading(device, scale_rows=fmt.block.n if fp8_compute else 1)
    if fp8_compute and device.type == "cuda":
        probe_fp8_paths(device)
    return model.eval()


def probe_fp8_paths(device: torch.device) -> dict[str, bool]:
    """Which library FP8 GEMMs this torch and GPU run (each checked once against its reference, before any CUDA graph
    capture, since the checks sync); the rest fall back to the Triton kernels. All three, whatever the format: a
    block-format layer narrower than its block computes per channel. Logged with the reason of a failure."""
    from workers.model import fp8_gemm, grouped_fp8_moe

    paths = {
        "scaled_mm blockwise": fp8_gemm.scaled_mm_available(device),
        "scaled_mm row-wise": fp8_gemm.rowwise_available(device),
        "scaled_grouped_mm row-wise": grouped_fp8_moe.available(device),
    }
    failures = fp8_gemm.PROBE_FAILURES
    log.info("fp8 GEMMs on %s: %s%s", device, ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in paths.items()),
             f" (failures: {failures})" if failures else "")
    return paths


def num_deepstack(model_config: ModelConfig) -> int:
    """How many first text layers take the vision tower's DeepStack features after them."""
    vision = getattr(model_config.hf_config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or [])


@dataclass
class LaunchedTokens:
    """A step on the device (the engine_api.LaunchedStep protocol): its sampled tokens in request_ids' order, and their
    copy to the host, begun (None: the step samples nothing); or, for a step that samples nothing, the work it
    queued (done). wait() returns once the step's own work has run, sampled or not: a step that returned before
    its work ran would let the next ones queue behind it unseen, so a large image's tower pass spread over steps
    would be queued whole in a few milliseconds and later arrivals would wait for all of it (Interactive on one
    H200, run99: 27 one-block steps of 1 ms each, then a prompt step of 1.66 s), and the step clock would learn
    the pass's time as the next prompt step's."""

    request_ids: list[str]
    tokens: torch.Tensor | None
    copy: HostCopy | None
    done: QueuedWork | None = None
    waited_s: float = 0.0  # how long wait() blocked

    def wait(self) -> dict[str, int]:
        started = time.perf_counter()
        if self.copy is None:
            if self.done is not None:
                self.done.wait()
                self.waited_s = time.perf_counter() - started
            return {}
        host = self.copy.wait()
        self.waited_s = time.perf_counter() - started
        return dict(zip(self.request_ids, host.tolist()))


class ModelRunner:
    """tp None: a single-process engine, or rank 0 of a multi-GPU instance (it starts the other ranks).
    tp given: rank tp.rank >= 1, driven by rank 0's messages (rank_group._rank_main)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tp: TensorParallel | None = None):
        self.config = config
        self.model_config = model_config
        self.ranks: RankGroup | None = None
        if tp is None and config.tensor_parallel_size > 1 and config.vision_tensor_parallel:
            check_vision_split(model_config.hf_config.vision_config, config.tensor_parallel_size)  # before any spawn
        if tp is None and config.tensor_parallel_size > 1:
            self.ranks = RankGroup(config, ModelRunner)
            tp = self.ranks.tp
        self.tp = tp or TensorParallel()
        self.device = torch.device(config.device if self.tp.size == 1 else f"cuda:{torch.cuda.current_device()}"
                                   if config.is_cuda else "cpu")
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.block_size = config.block_size
        text = model_config.text
        self.model = build_text_model(config, model_config, self.device, self.dtype, self.tp)
        checkpoint = None if config.load_format == "random" else config.checkpoint
        # rank 0's, and with vision_tensor_parallel every rank's shard of it (the other ranks keep no outputs)
        self.vision: VisionEncoder | None = None
        tower_tp = self.tp if self.tp.size > 1 and config.vision_tensor_parallel else None
        if self.tp.rank == 0 or tower_tp is not None:
            tower = vision_module(model_config, checkpoint, self.device, self.dtype, config.seed)
            self.vision = VisionEncoder(model_config, tower, self.device, self.dtype,
                                        fp8_linears=config.vision_precision == "fp8", attention=config.vision_attention,
                                        tp=tower_tp)
        self._shares_tower = self.ranks is not None and tower_tp is not None  # rank 0 sends every tower call
        self._kv_shape = (text.num_hidden_layers, config.block_size, text.num_key_value_heads // self.tp.size, text.head_dim)
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)
        self._kv_scales = None  # 1.0 each: a random-weight model, or a checkpoint without calibrated scales
        if config.kv_cache_dtype == "fp8" and checkpoint is not None:
            self._kv_scales = load_kv_scales(checkpoint, text.num_hidden_layers)
        num_blocks = config.num_kv_blocks or (self._blocks_from_memory() if config.is_cuda else CPU_DEFAULT_KV_BLOCKS)
        if self.tp.size > 1:  # every rank holds the same block ids: the smallest pool wins
            agreed = torch.tensor([num_blocks], device=self.device)
            torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=self.tp.group)
            num_blocks = int(agreed.item())
        # One block more than the block manager hands out: padded rows of a CUDA-graph batch write there.
        self.num_kv_blocks = num_blocks
        self.kv = self._new_kv_cache(num_blocks + 1)
        self.sampler = Sampler(self.device, config.seed)
        self.last_wait_s = 0.0  # the Executor protocol: the last step's wait for its sampled tokens
        # Vision-tower outputs the scheduler listed, until it frees them: (embeds, DeepStack) per image.
        self._encoded: dict[ImageKey, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._passes: dict[ImageKey, TowerState] = {}  # vision passes spread over steps, between their blocks
        # Where the passes' blocks run (engine.vision_green_sms): beside the steps, each finished pass's outputs
        # behind an event the step that reads them waits for; else on the step's stream (no events).
        self.tower_stream = TowerStream(self.device, config.vision_green_sms if self.vision is not None else 0)
        self._pass_done: dict[ImageKey, torch.cuda.Event] = {}  # until a step reads the pass's outputs
        self._in_flight: dict[ImageKey, torch.cuda.Event] = {}  # until finished_passes reports the pass done
        self.graphs: DecodeGraphs | None = None
        if config.is_cuda and not config.enforce_eager and DecodeGraphs.supported(self.dtype):
            self.graphs = DecodeGraphs(
                self.model, self.kv, min(config.max_num_seqs, MAX_GRAPH_BATCH),
                cdiv(config.max_model_len, self.block_size), scratch_block=num_blocks,
            )
        self.step_graphs: MixedStepGraphs | None = None
        if self.graphs is not None and config.mixed_step_graphs:
            self.step_graphs = MixedStepGraphs(
                self.model, self.kv, step_graph_sizes(config.max_num_batched_tokens),
                num_deepstack(model_config), scratch_block=num_blocks,
            )
        self.warm_up_report: dict | None = self.warm_up() if config.is_cuda and config.warm_up else None
        log.info("model runner ready: %s %s, KV pool of %d tokens (%d blocks of %d) in %s", self.device, self.dtype,
                 num_blocks * self.block_size, num_blocks, self.block_size, str(self.kv_dtype).removeprefix("torch."))

    @torch.inference_mode()
    def warm_up(self) -> dict:
        """One text step at each size whose fused-MoE tile configs differ (fused_moe.warm_up_tokens): Triton
        compiles each config on first use, and steps of those sizes would otherwise pay it mid-run. The steps
        write KV to the pool's first blocks, which no request holds yet. Every rank of an instance runs it at the
        same point (the steps' collectives); the engine's own warm-up then runs real steps with images."""
        t0 = time.perf_counter()
        moe = next((m for m in self.model.modules() if isinstance(m, SparseMoeBlock)), None)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        most = min(self.config.max_num_batched_tokens, self.num_kv_blocks * self.block_size)
        sizes = [] if moe is None else fused_moe.warm_up_tokens(moe.experts.gate_up_proj, moe.gate.top_k, most, device_name)
        tokens = []
        for n in sizes:
            batch, blocks = full_budget_batch(n, self.config.max_model_len, self.block_size)
            if blocks > self.num_kv_blocks:  # a pool this small: the step could never run either
                continue
            self.forward(StepInputs(batch=batch, visual=None, imports=[]), [n - 1])
            tokens.append(n)
        report = {"text_step_tokens": tokens}
        if self.vision is not None:  # the tower's large-image attention kernel, which the warm-up's images skip
            tower = self.vision.tower
            report["vision_attention_kernel"] = warm_up_kernel(
                tower.attention, tower.num_heads, tower.head_dim, self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        report["text_steps_s"] = round(time.perf_counter() - t0, 2)
        log.info("warm-up: text steps of %s tokens in %.1f s", tokens, report["text_steps_s"])
        return report

    def _new_kv_cache(self, num_blocks: int) -> KvCache:
        layers, block_size, heads, head_dim = self._kv_shape
        return KvCache(layers, num_blocks, block_size, heads, head_dim, self.kv_dtype, self.device, self._kv_scales)

    # ---- one step -------------------------------------------------------------------------------

    def idle(self) -> None:
        """A step with nothing scheduled: nothing runs on the device."""

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Runs one scheduled step (on every rank) and waits for it; returns the sampled token of every chunk that
        samples."""
        launched = self.launch(out)
        tokens = launched.wait()
        self.last_wait_s = launched.waited_s
        return tokens

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, after: LaunchedTokens | None = None) -> LaunchedTokens:
        """Queues one scheduled step (on every rank) and returns without waiting for its tokens. after: the step still
        running whose samples are this step's pending input tokens (PENDING_TOKEN), gathered on the device in stream
        order; a single-process engine only (can_overlap).

        The scheduler decides the vision tower's work: out.encode_now goes through it before the text tower,
        out.encode_ahead behind the step's sampling, so the GPU has that work while the host reads the tokens back
        and schedules the next step (on a second CUDA stream beside the text tower it was slower:
        benchmarks/README.md, run27)."""
        if after is not None and not self.can_overlap:
            raise RuntimeError("launch after a running step needs a single-process engine")
        for key in out.encoder_drop:
            self._drop_image(key)
        self.last_wait_s = 0.0
        if not out.chunks:  # vision-tower work alone (the blocks of a pass every prompt waits for)
            self._encode(out.encode_now)
            done = QueuedWork(self.device)
            self._encode(out.encode_ahead)
            return LaunchedTokens([], None, None, done)
        imports = [(seq.block_table, self.kv.import_rows(seq.kv_import, self.device)) for seq in out.kv_imports]
        chunks = sorted(out.chunks, key=lambda c: c.num_tokens != 1)  # single-row chunks (decodes) first
        batch = self._prepare(chunks, after)
        self._encode(out.encode_now)
        inputs = StepInputs(batch, self._visual_rows(chunks, batch.query_starts), imports)
        for key in out.encoder_free:
            self._encoded.pop(key, None)
            self._pass_done.pop(key, None)
        if self.ranks is not None:
            self.ranks.send_step(inputs)
        sampling = [(i, c.seq) for i, c in enumerate(chunks) if c.samples]
        logits = self.forward(inputs, [batch.query_starts[i + 1] - 1 for i, _ in sampling])
        ids = [seq.request_id for _, seq in sampling]
        tokens = self.sampler.sample(
            logits, ids, [seq.sampling for _, seq in sampling], [seq.grammar for _, seq in sampling]
        ) if sampling else None
        copy = HostCopy(tokens) if tokens is not None else None
        done = None if copy is not None else QueuedWork(self.device)  # a prompt chunk that samples nothing
        self._encode(out.encode_ahead)  # behind the step's own work: not waited for
        return LaunchedTokens(ids, tokens, copy, done)

    @property
    def can_overlap(self) -> bool:
        """launch after a running step works on a single-process engine (the StepLauncher protocol)."""
        return self.ranks is None and self.tp.size == 1

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, rows: list[int]) -> torch.Tensor | None:
        """This rank's part of one step: imported KV into the cache, the text tower; logits of `rows`."""
        lo, hi = self.tp.part(self.model_config.text.num_key_value_heads)
        for table, kv in inputs.imports:  # kv [layers, 2, tokens, all kv heads, head_dim], as this cache stores it
            self.kv.write(table, list(kv[:, 0, :, lo:hi]), list(kv[:, 1, :, lo:hi]))
        batch, visual = inputs.batch, inputs.visual
        if self.graphs is not None and visual is None and self.graphs.fits(batch):
            logits = self.graphs.run(batch)
            if not rows:  # ranks >= 1 (and steps that sample nothing): the graph ran for its collectives
                return None
            if len(rows) != batch.num_tokens:
                logits = logits[to_device(torch.tensor(rows), self.device)]
            return logits
        meta = batch.metadata(self.device, self.block_size)
        if self.step_graphs is not None and self.step_graphs.fits(batch, visual):
            hidden = self.step_graphs.run(batch, meta, visual)
        else:
            ids, positions = to_device(batch.input_ids, self.device), to_device(batch.positions, self.device)
            hidden = self.model(ids, positions, meta, self.kv.layers, visual)
        if not rows:
            return None
        return self.model.compute_logits(hidden[to_device(torch.tensor(rows), self.device)])

    def _prepare(self, chunks: list[ScheduledChunk], after: LaunchedTokens | None = None) -> StepBatch:
        """The flat batch of one step, built with array operations rather than per-sequence tensors. after: the
        running step whose samples are the pending input tokens (their rows then read on the device)."""
        n = len(chunks)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int64, n)
        los = np.fromiter((c.start for c in chunks), np.int64, n)
        deltas = np.fromiter((c.seq.mrope_position_delta for c in chunks), np.int64, n)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=starts[1:])
        total = int(starts[-1])
        ids = np.fromiter(
            itertools.chain.from_iterable(c.seq.token_ids[c.start : c.start + c.num_tokens] for c in chunks), np.int64, total
        )
        seq_of_row = np.repeat(np.arange(n), lens)
        index = np.arange(total) - starts[:-1][seq_of_row] + los[seq_of_row]  # token index within its sequence
        positions = np.broadcast_to(index + deltas[seq_of_row], (3, total)).copy()
        for i, c in enumerate(chunks):
            mm: MultiModalInput | None = c.seq.mm
            if mm is not None and c.start < c.seq.num_prompt_tokens:  # prompt rows keep the prompt's MRoPE layout
                split = min(c.seq.num_prompt_tokens, c.start + c.num_tokens)
                positions[:, starts[i] : starts[i] + split - c.start] = mm.positions[:, c.start : split].numpy()
        width = max(len(c.seq.block_table) for c in chunks)
        tables = np.zeros((n, width), np.int32)
        for i, c in enumerate(chunks):
            tables[i, : len(c.seq.block_table)] = c.seq.block_table.array
        slots = tables[seq_of_row, index // self.block_size].astype(np.int64) * self.block_size + index % self.block_size
        return StepBatch(
            input_ids=self._input_ids(ids, chunks, starts, after),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(tables),
            context_lens=(los + lens).tolist(),
            query_starts=starts.tolist(),
            num_decodes=int((lens == 1).sum()),
        )

    def _input_ids(self, ids: np.ndarray, chunks: list[ScheduledChunk], starts: np.ndarray,
                   after: LaunchedTokens | None) -> torch.Tensor:
        """The step's input tokens: on the host, or on the device where some are pending, those rows gathered from
        `after`'s sampled tokens (in stream order, so this step's inputs exist once that step has sampled)."""
        rows = np.flatnonzero(ids == PENDING_TOKEN)
        if rows.size == 0:
            return torch.from_numpy(ids)
        if after is None or after.tokens is None:
            raise ValueError("launch: pending input tokens, but no running step that samples them")
        sampled = {rid: i for i, rid in enumerate(after.request_ids)}
        owner = np.searchsorted(starts, rows, side="right") - 1
        missing = [chunks[i].seq.request_id for i in owner if chunks[i].seq.request_id not in sampled]
        if missing:
            raise ValueError(f"launch: {missing} did not sample in the step it follows")
        index = to_device(torch.tensor([sampled[chunks[i].seq.request_id] for i in owner]), self.device)
        pending = after.tokens.index_select(0, index)
        if rows.size == ids.size:  # decodes alone, all following the running step
            return pending
        ids[rows] = 0
        return to_device(torch.from_numpy(ids), self.device).index_copy_(0, to_device(torch.from_numpy(rows), self.device),
                                                                         pending)

    def _visual_rows(self, chunks: list[ScheduledChunk], starts: list[int]) -> VisualRows | None:
        """Visual embeddings for the <|image_pad|> rows of this step, from the encoder outputs the scheduler had
        made (now or in an earlier step)."""
        rows, embeds, deepstack = [], [], []
        for i, chunk in enumerate(chunks):
            lo, hi = chunk.start, chunk.start + chunk.num_tokens
            for image in chunk.seq.images:
                first, last = max(lo, image.start), min(hi, image.end)
                if first >= last:
                    continue
                encoded = self._encoded.get((chunk.seq.request_id, image.index))
                if encoded is None:
                    raise RuntimeError(f"image {image.index} of request {chunk.seq.request_id} is not encoded: the "
                                       f"step reads its rows {first}-{last - 1} but the scheduler never listed it")
                emb, ds = encoded
                if (key := (chunk.seq.request_id, image.index)) in self._pass_done:  # made beside the steps
                    self.tower_stream.hand_over(self._pass_done.pop(key), [emb, *ds])
                rows.append(torch.arange(first, last) - lo + starts[i])
                embeds.append(emb[first - image.start : last - image.start])
                deepstack.append([d[first - image.start : last - image.start] for d in ds])
        if not rows:
            return None
        return VisualRows(
            rows=to_device(torch.cat(rows), self.device),
            embeds=torch.cat(embeds),
            deepstack=[torch.cat(layer) for layer in zip(*deepstack)],
        )

    def _encode(self, encodes: list[ImageEncode]) -> None:
        """The listed vision-tower work: whole images in one pass together, then the blocks of passes spread over
        steps (kept between steps as the tower's state). Outputs wait under their keys until freed. A
        tensor-parallel tower's other ranks get the same work first (rank_group.send_tower_work)."""
        if not encodes:
            return
        if self.vision is None:
            raise RuntimeError("the scheduler listed images to encode, but this model has no vision tower")
        whole = [e for e in encodes if not e.num_blocks]
        patches, grids = zip(*(self._image_patches(e) for e in whole)) if whole else ((), ())
        passes = [PassBlocks(e.key, e.first_block, e.num_blocks, *(self._image_patches(e) if e.first_block == 0
                                                                    else (None, None)))
                  for e in encodes if e.num_blocks]
        work = TowerWork([(e.key, e.image.num_tokens) for e in whole], torch.cat(patches) if whole else None,
                         torch.cat(grids) if whole else None, passes)
        if self._shares_tower:
            self.ranks.send_tower_work(work)
        self.run_tower(work)

    def run_tower(self, work: TowerWork) -> None:
        """Runs one call's tower work on this rank (rank 0 keeps the outputs under their keys; the other ranks of a
        tensor-parallel tower run their shard for its all-reduces and keep only the passes' states)."""
        if work.whole_patches is not None:
            out = self.vision.encode(normalise_patches(work.whole_patches, self.vision.dtype), work.whole_grids)
            if out is not None:
                embeds, deepstack = out
                sizes = [tokens for _, tokens in work.whole]
                for (key, _), emb, *ds in zip(work.whole, embeds.split(sizes), *(d.split(sizes) for d in deepstack)):
                    self._encoded[key] = (emb, list(ds))
        if not work.passes:
            return
        if self.tower_stream.active:  # the grids' tables cached on the step's stream, which whole images read too
            for blocks in work.passes:
                if blocks.first_block == 0:
                    self.vision.tower.tables([tuple(g) for g in blocks.grid.tolist()])
            self.tower_stream.uses([b.patches for b in work.passes if b.patches is not None])
        with self.tower_stream.beside():
            for blocks in work.passes:
                self._run_blocks(blocks)

    def _run_blocks(self, blocks: PassBlocks) -> None:
        if blocks.first_block == 0:
            state = self.vision.begin(normalise_patches(blocks.patches, self.vision.dtype), blocks.grid)
            self.tower_stream.uses([state.cos, state.sin, state.pending])  # the cached tables
            self._passes[blocks.key] = state
        state = self._passes.get(blocks.key)
        if state is None or state.next_block != blocks.first_block:
            request_id, index = blocks.key
            raise RuntimeError(f"image {index} of request {request_id}: the scheduler listed blocks from "
                               f"{blocks.first_block}, the pass is at {None if state is None else state.next_block}")
        self.vision.run_blocks(state, blocks.num_blocks)
        if state.next_block == self.vision.depth:
            del self._passes[blocks.key]
            out = self.vision.finish(state)
            if out is not None:
                emb, ds = out
                self._encoded[blocks.key] = (emb, list(ds))
                if (done := self.tower_stream.mark()) is not None:
                    self._pass_done[blocks.key] = self._in_flight[blocks.key] = done

    def finished_passes(self) -> list[ImageKey]:
        """The TowerBeside protocol: passes whose last block has run on the side stream since the last call (a pass
        runs whole there, and its outputs exist once its event has passed)."""
        done = [key for key, event in self._in_flight.items() if event.query()]
        for key in done:
            del self._in_flight[key]
        return done

    def wait_passes(self) -> None:
        """The TowerBeside protocol: blocks until the oldest pass on the side stream is done."""
        if self._in_flight:
            next(iter(self._in_flight.values())).synchronize()

    def _image_patches(self, encode: ImageEncode) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's uint8 patches on the device and its grid row: its resized pixels copied there (on CUDA from
        page-locked memory: one asynchronous DMA, an eighth of the float32 rows' bytes), cut into merge-block order
        there (normalised by the caller)."""
        mm: MultiModalInput = encode.seq.mm
        index = encode.image.index
        return merge_block_patches(to_device(mm.pixels[index], self.device)), mm.grid_thw[index : index + 1]

    def _drop_image(self, key: ImageKey) -> None:
        self._encoded.pop(key, None)
        self._pass_done.pop(key, None)
        self._in_flight.pop(key, None)
        if self.drop_pass(key) and self._shares_tower:
            self.ranks.send(("vision_drop", key))

    def drop_pass(self, key: ImageKey) -> bool:
        """Forgets an unfinished tower pass (a dropped or released request's); whether there was one."""
        return self._passes.pop(key, None) is not None

    # ---- request lifecycle ------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Forgets per-request state (encoder outputs, seeded generator) of a finished request."""
        for key in [k for k in (*self._encoded, *self._passes) if k[0] == request_id]:
            self._drop_image(key)
        self.sampler.release(request_id)

    def export_kv(self, seq: Sequence, on_device: bool = False) -> KvExport:
        """The request's KV (all ranks' KV heads) as the cache stores it (FP8 with its scales, or the activation
        dtype), on the CPU or (on_device) on this rank's device."""
        if self.ranks is not None:
            self.ranks.send(("gather_kv", seq.block_table, seq.num_computed_tokens))
        kv = self.gather_kv(seq.block_table, seq.num_computed_tokens)
        if not on_device:
            kv = kv.cpu()
        return KvExport(
            num_tokens=seq.num_computed_tokens,
            first_token_id=seq.token_ids[seq.num_computed_tokens],
            mrope_position_delta=seq.mrope_position_delta,
            keys=list(kv[:, 0]),
            values=list(kv[:, 1]),
            scales=list(self.kv.scales) if self.kv.is_fp8 else None,
        )

    def gather_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """[layers, 2, tokens, all kv heads, head_dim] on this device; every rank takes part (all-gather)."""
        local = self.kv.gather(block_table, num_tokens)
        if self.tp.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        if local.dtype.itemsize == 1:  # FP8 as bytes: the collectives need not know float8
            torch.distributed.all_gather([p.view(torch.uint8) for p in parts], local.contiguous().view(torch.uint8),
                                         group=self.tp.group)
        else:
            torch.distributed.all_gather(parts, local, group=self.tp.group)
        return torch.cat(parts, dim=3)

    def close(self) -> None:
        """Frees the decode and mixed-step CUDA graphs first (under tensor parallelism they hold captured NCCL work, and tearing
        the communicator down under live graphs can wait forever), then stops the other ranks (rank 0 only)."""
        if self.graphs is not None:
            self.graphs = self.step_graphs = None
            gc.collect()
            torch.cuda.synchronize(self.device)
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    # ---- KV pool sizing on CUDA -------------------------------------------------------------------

    @torch.inference_mode()
    def _blocks_from_memory(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the device after the weights and the activation
        peak of a full-budget text step: max_num_batched_tokens rows, as sequences of at most max_model_len
        (the vision tower's peak is not profiled; leave headroom). The step also compiles the kernels of
        full-budget steps, which the first real one would otherwise pay."""
        batch, num_blocks = full_budget_batch(self.config.max_num_batched_tokens, self.config.max_model_len, self.block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = self._new_kv_cache(num_blocks)
        hidden = self.model(
            to_device(batch.input_ids, self.device), to_device(batch.positions, self.device),
            batch.metadata(self.device, self.block_size), scratch.layers,
        )
        self.model.compute_logits(hidden[to_device(torch.tensor(batch.query_starts[1:]) - 1, self.device)])
        del scratch, hidden
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - (peak - current)
        block_bytes = KvCache.bytes_per_block(*self._kv_shape, self.kv_dtype)  # FP8: half the bytes, twice the blocks
        num_blocks = int(budget // block_bytes)
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB at "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization})"
            )
        return num_blocks
