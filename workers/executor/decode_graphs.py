"""The flat batch of one step (StepBatch) and CUDA graphs that replay decode-only steps (DecodeGraphs).

A decode-only step of n sequences replays the graph of the smallest captured batch size >= n (graph_batch_sizes);
padded rows write their K/V into a scratch block and are never sampled. They all carry one token at position 0, so
that they route to one set of experts in each MoE layer: left holding an earlier, larger batch's tokens, each padded
row routed to experts of its own, and a small step's experts are its weight reads (uniform routing: 9 sequences in
the graph of 16 read ~82 of 128 experts a layer with 16 distinct tokens, ~61 with 10).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from workers.host_copy import StagingBuffers, to_device
from workers.kv_cache import KvCache
from workers.model import paged_decode
from workers.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


@dataclass
class StepBatch:
    """Host tensors of one step: chunk i is rows query_starts[i]:query_starts[i+1]; the first
    num_decodes chunks are single rows."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [3, T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, W] int32
    context_lens: list[int]  # [B]
    query_starts: list[int]  # [B + 1]
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    def metadata(self, device: torch.device, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=to_device(self.slot_mapping, device),
            block_tables=to_device(self.block_tables, device),
            context_lens=to_device(torch.tensor(self.context_lens, dtype=torch.int32), device),
            block_size=block_size,
            num_decodes=self.num_decodes,
            query_starts=self.query_starts,
            context_lens_host=self.context_lens,
        )


def full_budget_batch(num_tokens: int, max_len: int, block_size: int) -> tuple[StepBatch, int]:
    """A text step of num_tokens prompt rows, as first chunks of sequences of at most max_len tokens whose KV goes
    to consecutive blocks from block 0; and the number of blocks they use. The engine profiles its activation
    peak (and compiles its kernels for full steps) on it."""
    lens = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
    blocks = [-(-n // block_size) for n in lens]
    firsts = [sum(blocks[:i]) for i in range(len(lens))]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, (first, n) in enumerate(zip(firsts, blocks)):
        tables[i, :n] = torch.arange(first, first + n, dtype=torch.int32)
    batch = StepBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long),
        positions=torch.cat([torch.arange(n) for n in lens]).repeat(3, 1),
        slot_mapping=torch.cat([torch.arange(first * block_size, first * block_size + n) for first, n in zip(firsts, lens)]),
        block_tables=tables,
        context_lens=lens,
        query_starts=[0, *itertools.accumulate(lens)],
        num_decodes=0,
    )
    return batch, sum(blocks)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Every size from 1 to 8, then every multiple of 16 up to max_batch (and max_batch itself). Below 16 sequences a
    decode step's time grows with each token's experts (benchmarks/README.md, thirty-seventh pass: 5.4 ms for one
    sequence, 8.0 for four, 11.0 for eight on an H100), so a small batch runs unpadded; past that 8 of 128 experts a
    token leave few untouched, and the padded rows (one token, DecodeGraphs.run) add little."""
    sizes = [s for s in range(1, 9) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    """Logits of decode-only steps by graph replay. Inputs live in static buffers of max_batch rows."""

    @staticmethod
    def supported(dtype: torch.dtype) -> bool:
        return paged_decode.triton is not None and dtype in (torch.bfloat16, torch.float16)

    def __init__(self, model: torch.nn.Module, kv: KvCache, max_batch: int, max_blocks: int, scratch_block: int):
        device = kv.tensor.device
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.max_batch = max_batch
        self.scratch_slot = scratch_block * kv.block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(3, max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_batch, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.staging = self.staging_for(max_batch, max_blocks, device)
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    @staticmethod
    def staging_for(max_batch: int, max_blocks: int, device: torch.device) -> StagingBuffers:
        """Pinned host buffers for a step's inputs, the static buffers' sizes."""
        return StagingBuffers({
            "input_ids": (max_batch, torch.long),
            "positions": (3 * max_batch, torch.long),
            "slot_mapping": (max_batch, torch.long),
            "block_tables": (max_batch * max_blocks, torch.int32),
            "context_lens": (max_batch, torch.int32),
        }, device)

    def fits(self, batch: StepBatch) -> bool:
        n = len(batch.context_lens)
        return batch.num_decodes == n and n <= self.max_batch and batch.block_tables.shape[1] <= self.block_tables.shape[1]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            block_size=self.block_size,
            num_decodes=size,
            query_starts=[],
            context_lens_host=[],
        )
        hidden = self.model(self.input_ids[:size], self.positions[:, :size], meta, self.kv.layers)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)  # warm-up: compiles kernels, creates handles
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only batch of n sequences (a view into the graph's output)."""
        n = len(batch.context_lens)
        size = next(s for s in self.sizes if s >= n)
        width = batch.block_tables.shape[1]
        with self.staging.step() as stage:  # input_ids is a device tensor where the tokens are pending: copied there
            stage.copy_into("input_ids", self.input_ids[:n], batch.input_ids)
            stage.copy_into("positions", self.positions[:, :n], batch.positions)
            stage.copy_into("slot_mapping", self.slot_mapping[:n], batch.slot_mapping)
            stage.copy_into("block_tables", self.block_tables[:n, :width], batch.block_tables)
            stage.copy_into("context_lens", self.context_lens[:n], batch.context_lens)
        if size > n:  # padded rows: no real slot may be written, and their attention reads one scratch row
            self.input_ids[n:size].fill_(0)  # one token at one position for all of them: one set of experts
            self.positions[:, n:size].fill_(0)
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.context_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.scratch_slot // self.block_size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
