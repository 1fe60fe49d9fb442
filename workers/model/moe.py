"""Qwen3-VL MoE feed-forward: fp32 softmax router, top-k renormalised, SwiGLU experts in fused weights.

Experts are held as transformers holds them in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]; under
tensor parallelism each rank holds I/size of every expert, under expert parallelism E/size whole experts
(pairs routed to another rank's experts contribute zero here; the caller all-reduces).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import fp8_gemm, fused_moe, grouped_fp8_moe, moe_routing, route_align
from workers.model import fp8
from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import FP8_DTYPE, dequantize_weight_blocks
from workers.model.moe_routing import Alignment
from workers.model.norm_quant import Fp8Input, Fp8Rows
from workers.parallel import TensorParallel


class MoeRouter(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k

    def forward(self, x: torch.Tensor, expert_range: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x.dtype, expert ids [T, k] int64); with expert_range (lo, hi) the ids
        are local to it and an expert outside it is hi - lo (see moe_routing.route)."""
        return moe_routing.route(F.linear(x, self.weight), self.top_k, expert_range)

    def route_aligned(self, x: torch.Tensor, expert_range: tuple[int, int] | None, num_bins: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
        """forward, and its pairs aligned in blocks of block_m over num_bins bins (route_align: one launch for
        decode-sized steps)."""
        return route_align.route_and_align(F.linear(x, self.weight), self.top_k, expert_range, num_bins, block_m)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, K] rows grouped by expert, b [E, K, N], offs [E] int32 cumulative row counts -> [M, N].

    torch._grouped_mm where it runs (CUDA bf16 on sm90+, or torch's CPU kernel); else a loop over
    groups (a reference path that syncs on offs, so not CUDA-graph safe)."""
    if _native_grouped_mm(a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[expert]
        start = end
    return out


def _native_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if a.is_cuda:
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0)
    return _cpu_grouped_mm_works()


@functools.cache
def _cpu_grouped_mm_works() -> bool:
    try:
        a = torch.ones(2, 16)
        torch._grouped_mm(a, torch.ones(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def fake_quantize_activations(x: torch.Tensor, block: BlockShape) -> torch.Tensor:
    """x rounded as the W8A8 kernels see it, in groups of fp8.activation_group(block, K) columns."""
    return fp8.fake_quantize_activations(x, fp8.activation_group(block, x.shape[-1]))


# Per-channel FP8 experts take torch's grouped FP8 GEMM (grouped_fp8_moe) from this many tokens a step; below it the
# Triton kernels. H200, 30B-A3B experts (scripts/bench_fp8.py, benchmarks/README.md eleventh pass), us a call:
# 256 tokens Triton 212, grouped 317; 1,024: 400 and 402; 8,192: 1,412 and 1,166 (bf16 1,273).
GROUPED_FP8_MIN_TOKENS = 2048


class MoeExperts(nn.Module):
    """block None: expert weights in the activation dtype. Else float8_e4m3fn with a float32 scale per block of
    block.n rows x block.k columns of each expert (gate_up_scale [E, ceil(2I/bn), ceil(H/bk)], down_scale
    [E, ceil(H/bn), ceil(I/bk)])."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, block: BlockShape | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.block = block
        dtype = FP8_DTYPE if block is not None else None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False)
        if block is not None:
            self.gate_up_scale = nn.Parameter(
                torch.empty(num_experts, *block.grid(2 * intermediate_size, hidden_size), dtype=torch.float32), requires_grad=False)
            self.down_scale = nn.Parameter(
                torch.empty(num_experts, *block.grid(hidden_size, intermediate_size), dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, foreign: bool = False, *,
                aligned: Alignment | None = None, x_fp8: Fp8Rows | None = None) -> torch.Tensor:
        """The fused Triton kernels on CUDA (bf16/fp16), else the grouped-GEMM path. foreign: top_i may hold
        num_experts, a pair served by another rank, which contributes zero. aligned / x_fp8: the pairs already
        aligned (the tiled path) and x already quantised (the tiled and grouped FP8 paths), as alignment / fp8_input
        said."""
        path = self.path(x)
        if path == "reference":
            return self.grouped(x, top_w, top_i, foreign)
        if path == "grouped_fp8":
            return grouped_fp8_moe.grouped_fp8_experts(
                x, top_w, top_i, self.gate_up_proj, self.down_proj, self.gate_up_scale, self.down_scale, foreign,
                x_fp8=x_fp8)
        fast = dict(aligned=aligned, x_fp8=x_fp8)
        if self.block is None:
            return fused_moe.fused_experts(x, top_w, top_i, self.gate_up_proj, self.down_proj, foreign, **fast)
        if not self.per_channel:
            return fused_moe.fused_experts(
                x, top_w, top_i, self.gate_up_proj, self.down_proj, foreign,
                gate_up_scale=self.gate_up_scale, down_scale=self.down_scale, block=self.block, **fast,
            )
        # the Triton kernels on per-channel scales seen as one per row and 128 columns (stride 0 along K): the
        # GEMV path W8A16, the tiled one with activation groups of 128 (finer than the format's per-token)
        row_block = BlockShape(1, fused_moe.FP8_BLOCK_K)
        gate_up_scale = self.gate_up_scale.expand(self.num_experts, *row_block.grid(*self.gate_up_proj.shape[1:]))
        down_scale = self.down_scale.expand(self.num_experts, *row_block.grid(*self.down_proj.shape[1:]))
        return fused_moe.fused_experts(
            x, top_w, top_i, self.gate_up_proj, self.down_proj, foreign,
            gate_up_scale=gate_up_scale, down_scale=down_scale, block=row_block, **fast,
        )

    def path(self, x: torch.Tensor) -> str:
        """Which kernels forward runs for x: "gemv" or "tiled" (the fused Triton kernels), "grouped_fp8" (torch's
        grouped FP8 GEMMs, per-channel experts from GROUPED_FP8_MIN_TOKENS tokens) or "reference" (off CUDA)."""
        if not fused_moe.supports(x):
            return "reference"
        tokens = x.shape[0]
        if self.per_channel and tokens >= GROUPED_FP8_MIN_TOKENS and grouped_fp8_moe.available(x.device):
            return "grouped_fp8"
        return "gemv" if tokens <= fused_moe.SMALL_BATCH_TOKENS else "tiled"

    def alignment(self, x: torch.Tensor, top_k: int) -> int | None:
        """The BLOCK_M the tiled path aligns x's pairs to first (the router may align them in its launch), else None."""
        if self.path(x) != "tiled":
            return None
        device = torch.cuda.get_device_name(x.device) if x.is_cuda else None
        return fused_moe.gated_tiles(x.shape[0] * top_k, self.gate_up_proj, device).block_m

    def fp8_input(self, x: torch.Tensor) -> Fp8Input | None:
        """FP8 experts read x quantised per token and 128 columns on the tiled path, per token on the grouped FP8
        path; the router reads x itself."""
        path = self.path(x) if self.block is not None else None
        if path == "tiled":
            return Fp8Input(fused_moe.FP8_BLOCK_K, rows_too=True)
        if path == "grouped_fp8":
            return Fp8Input(fp8_gemm.token_group(x.shape[-1]), rows_too=True)
        return None

    @property
    def per_channel(self) -> bool:
        """FP8 experts with one scale per output row (per-token activations; fp8.activation_group)."""
        return self.block is not None and fp8_gemm.per_channel(self.block, max(self.gate_up_proj.shape[2], self.down_proj.shape[2]))

    def grouped(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, foreign: bool = False) -> torch.Tensor:
        """Token-expert pairs sorted by expert, two grouped GEMMs, then each token's k outputs weighted and
        summed. Sync-free (moe_routing.sort_pairs), so it can be captured in a CUDA graph."""
        tokens, k = top_i.shape
        order, offs = moe_routing.sort_pairs(top_i, self.num_experts, foreign)
        xs = x[order // k]
        if self.block is not None:  # the W8A8 kernels' numbers in float32: activations rounded, weights dequantized
            gate_up, down = self.dequantized()
            gate, up = grouped_mm(fake_quantize_activations(xs, self.block), gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
            act = (F.silu(gate) * up).to(x.dtype)
            ys = grouped_mm(fake_quantize_activations(act, self.block), down.transpose(1, 2), offs).to(x.dtype)
        else:
            gate, up = grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs).chunk(2, dim=-1)
            ys = grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs)
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(tokens, k, -1)
        if foreign:
            y = torch.where((top_i < self.num_experts).unsqueeze(-1), y, 0)
        return (y * top_w.unsqueeze(-1)).sum(dim=1)


    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 experts' weights dequantized to float32 (the reference path's operands)."""
        return (dequantize_weight_blocks(self.gate_up_proj, self.gate_up_scale, self.block),
                dequantize_weight_blocks(self.down_proj, self.down_scale, self.block))


class SparseMoeBlock(nn.Module):
    """Router over all experts; this rank's experts (or expert slices). The output is this rank's partial
    sum when tp.size > 1 (the decoder layer all-reduces it)."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, tp: TensorParallel | None = None,
        block: BlockShape | None = None,
    ):
        super().__init__()
        tp = tp or TensorParallel()
        self.gate = MoeRouter(num_experts, hidden_size, top_k)
        self.expert_range = tp.part(num_experts) if tp.expert_parallel and tp.size > 1 else None
        if self.expert_range is None:
            self.experts = MoeExperts(num_experts, hidden_size, intermediate_size // tp.size, block)
        else:
            self.experts = MoeExperts(num_experts // tp.size, hidden_size, intermediate_size, block)

    def forward(self, h: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """h: the normed rows, or their FP8 form with the rows beside it (fp8_input). Where the tiled path runs, the
        router's launch also aligns the pairs for it."""
        x = h.rows if isinstance(h, Fp8Rows) else h
        foreign = self.expert_range is not None
        x_fp8 = h if isinstance(h, Fp8Rows) else None
        block_m = self.experts.alignment(x, self.gate.top_k)
        if block_m is None:
            top_w, top_i = self.gate(x, self.expert_range)
            return self.experts(x, top_w, top_i, foreign=foreign, x_fp8=x_fp8)
        top_w, top_i, aligned = self.gate.route_aligned(x, self.expert_range, self.experts.num_experts + foreign, block_m)
        return self.experts(x, top_w, top_i, foreign=foreign, aligned=aligned, x_fp8=x_fp8)

    def fp8_input(self, x: torch.Tensor) -> Fp8Input | None:
        return self.experts.fp8_input(x)
