"""ModelRunner: the only part of the engine that holds tensors and devices.

Loads the model and the KV pool, turns a SchedulerOutput into a flat batch (positions, slot mapping,
block tables, visual rows), runs the vision tower and the text tower, and samples the next tokens.
"""

from __future__ import annotations

import logging

import torch

from workers.block_manager import cdiv
from workers.config import CPU_DEFAULT_KV_BLOCKS, EngineConfig
from workers.kv_cache import KvCache, KvExport
from workers.model.attention import AttentionMetadata
from workers.model.mm_inputs import MultiModalInput
from workers.model.text import Qwen3VLTextForEngine, VisualRows
from workers.model.vision import VisionEncoder
from workers.sampler import Sampler
from workers.scheduler import ScheduledChunk, SchedulerOutput
from workers.sequence import Sequence
from workers.weights import ModelConfig, load_text_weights

log = logging.getLogger(__name__)


def build_text_model(config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype):
    """The text tower with checkpoint weights, allocated once on the target device in the target dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3VLTextForEngine(model_config.text)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    load_text_weights(model, config.checkpoint, model_config.tie_word_embeddings, dtype)
    model.init_rotary(device)
    return model.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.torch_dtype_name)
        self.block_size = config.block_size
        text = model_config.text
        self.model = build_text_model(config, model_config, self.device, self.dtype)
        self.vision = VisionEncoder(model_config, config.checkpoint, self.device, self.dtype)
        self._kv_shape = (text.num_hidden_layers, config.block_size, text.num_key_value_heads, text.head_dim)
        num_blocks = config.num_kv_blocks or (self._blocks_from_memory() if config.is_cuda else CPU_DEFAULT_KV_BLOCKS)
        self.kv = self._new_kv_cache(num_blocks)
        self.sampler = Sampler(self.device, config.seed)
        self._encoded: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        log.info("model runner ready: %s %s, %d KV blocks of %d tokens", self.device, self.dtype, num_blocks, self.block_size)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    def _new_kv_cache(self, num_blocks: int) -> KvCache:
        layers, block_size, heads, head_dim = self._kv_shape
        return KvCache(layers, num_blocks, block_size, heads, head_dim, self.dtype, self.device)

    # ---- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Runs one scheduled step; returns the sampled token of every chunk that samples."""
        for seq in out.kv_imports:
            self.kv.write(seq.block_table, seq.kv_import.keys, seq.kv_import.values)
        chunks = out.chunks
        input_ids, positions, slots, starts, tables = [], [], [], [0], []
        for chunk in chunks:
            seq, lo, hi = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            input_ids.append(torch.tensor(seq.token_ids[lo:hi], dtype=torch.long))
            positions.append(self._positions(seq, lo, hi))
            idx = torch.arange(lo, hi)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            slots.append(table[idx // self.block_size] * self.block_size + idx % self.block_size)
            starts.append(starts[-1] + chunk.num_tokens)
            tables.append(seq.block_table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(self.device),
            query_starts=starts,
            context_lens=[c.start + c.num_tokens for c in chunks],
            block_tables=block_tables.to(self.device),
            block_size=self.block_size,
        )
        visual = self._visual_rows(chunks, starts)
        hidden = self.model(
            torch.cat(input_ids).to(self.device), torch.cat(positions, dim=1).to(self.device), meta, self.kv.layers, visual
        )
        sampling = [(i, c.seq) for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return {}
        rows = torch.tensor([starts[i + 1] - 1 for i, _ in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        ids = [seq.request_id for _, seq in sampling]
        tokens = self.sampler.sample(logits, ids, [seq.sampling for _, seq in sampling])
        return dict(zip(ids, tokens))

    def _positions(self, seq: Sequence, lo: int, hi: int) -> torch.Tensor:
        """[3, hi - lo] MRoPE positions: the prompt's own layout, then index + delta on all axes."""
        mm: MultiModalInput | None = seq.mm
        split = min(max(lo, seq.num_prompt_tokens if mm is not None else lo), hi)
        tail = torch.arange(split, hi).expand(3, -1) + seq.mrope_position_delta
        if split == lo:
            return tail
        return torch.cat([mm.positions[:, lo:split], tail], dim=1)

    def _visual_rows(self, chunks: list[ScheduledChunk], starts: list[int]) -> VisualRows | None:
        """Visual embeddings for the <|image_pad|> rows of this step, encoding images on first need."""
        parts = []
        for i, chunk in enumerate(chunks):
            mm: MultiModalInput | None = chunk.seq.mm
            if mm is None:
                continue
            lo, hi = chunk.start, chunk.start + chunk.num_tokens
            first = int(torch.searchsorted(mm.image_rows, lo))
            last = int(torch.searchsorted(mm.image_rows, hi))
            if first < last:
                parts.append((i, chunk.seq, first, last))
        if not parts:
            return None
        self._encode([seq for _, seq, _, _ in parts if seq.request_id not in self._encoded])
        rows, embeds, deepstack = [], [], []
        for i, seq, first, last in parts:
            emb, ds = self._encoded[seq.request_id]
            rows.append(seq.mm.image_rows[first:last] - chunks[i].start + starts[i])
            embeds.append(emb[first:last])
            deepstack.append([d[first:last] for d in ds])
            if last == len(seq.mm.image_rows):  # every image token is now in the KV cache
                del self._encoded[seq.request_id]
        return VisualRows(
            rows=torch.cat(rows).to(self.device),
            embeds=torch.cat(embeds),
            deepstack=[torch.cat(layer) for layer in zip(*deepstack)],
        )

    def _encode(self, seqs: list[Sequence]) -> None:
        """One vision-tower pass over all images of the given sequences."""
        if not seqs:
            return
        pixel_values = torch.cat([s.mm.pixel_values for s in seqs])
        grid_thw = torch.cat([s.mm.grid_thw for s in seqs])
        embeds, deepstack = self.vision.encode(pixel_values, grid_thw)
        sizes = [len(s.mm.image_rows) for s in seqs]
        for n, seq in enumerate(seqs):
            self._encoded[seq.request_id] = (
                embeds.split(sizes)[n],
                [d.split(sizes)[n] for d in deepstack],
            )

    # ---- request lifecycle ------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Forgets per-request state (encoder outputs, seeded generator) of a finished request."""
        self._encoded.pop(request_id, None)
        self.sampler.release(request_id)

    def export_kv(self, seq: Sequence) -> KvExport:
        keys, values = self.kv.read(seq.block_table, seq.num_computed_tokens)
        return KvExport(
            num_tokens=seq.num_computed_tokens,
            first_token_id=seq.token_ids[seq.num_computed_tokens],
            mrope_position_delta=seq.mrope_position_delta,
            keys=keys,
            values=values,
        )

    # ---- KV pool sizing on CUDA -------------------------------------------------------------------

    @torch.inference_mode()
    def _blocks_from_memory(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the device after the weights and the activation
        peak of a full-budget text step (the vision tower's peak is not profiled; leave headroom)."""
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = self._new_kv_cache(cdiv(num_tokens, self.block_size))
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            query_starts=[0, num_tokens],
            context_lens=[num_tokens],
            block_tables=torch.arange(scratch.num_blocks, dtype=torch.int32, device=self.device).unsqueeze(0),
            block_size=self.block_size,
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device).expand(3, -1)
        hidden = self.model(ids, positions, meta, scratch.layers)
        self.model.compute_logits(hidden[-1:])
        del scratch, hidden
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - (peak - current)
        block_bytes = KvCache.bytes_per_block(*self._kv_shape, self.dtype)
        num_blocks = int(budget // block_bytes)
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB at "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization})"
            )
        return num_blocks
