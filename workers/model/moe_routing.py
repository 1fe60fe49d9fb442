"""MoE routing kernels: top-k expert choice from router logits, the alignment of token-expert pairs into
expert-sorted blocks for the tiled experts, and the pairs' rows for torch's grouped GEMMs (pair_layout); Triton on
CUDA, with the torch references used on CPU.

Both are graph-safe: output sizes depend only on the token count, and nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ALIGN_SUB = 64  # pairs per step of the align kernels' running per-expert count
ALIGN_PROGRAMS = 128  # the align kernels split the pairs into about this many chunks


def on_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


def route(logits: torch.Tensor, top_k: int, expert_range: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits.dtype, expert ids [T, k] int64): softmax in float32, the
    top k, renormalised to sum 1. expert_range (lo, hi): ids become local (id - lo), and an expert outside
    [lo, hi) becomes hi - lo (a pair served by another rank)."""
    lo, hi = expert_range or (0, logits.shape[1])
    if on_triton(logits):
        return route_triton(logits, top_k, lo, hi)
    return route_reference(logits, top_k, lo, hi)


def route_reference(logits: torch.Tensor, top_k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if (lo, hi) != (0, logits.shape[1]):
        top_i = torch.where((top_i >= lo) & (top_i < hi), top_i - lo, hi - lo)
    return top_w.to(logits.dtype), top_i


def route_triton(logits: torch.Tensor, top_k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per token; ties go to the lower expert id."""
    tokens, num_experts = logits.shape
    top_w = logits.new_empty(tokens, top_k)
    top_i = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, top_w, top_i, logits.stride(0), num_experts, lo, hi,
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), num_warps=1,
        )
    return top_w, top_i


def sort_pairs(top_i: torch.Tensor, num_experts: int, foreign: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMMs' layout of token-expert pairs: (order, offs), order [T * k] the pair ids (token * k + slot)
    sorted by expert, stably, and offs [num_experts] int32 each local expert's cumulative row count. foreign: top_i
    may hold num_experts (another rank's pair); those sort last, past the last offset. Sync-free (offsets by histc,
    not bincount), so it can be captured in a CUDA graph."""
    flat = top_i.reshape(-1)
    bins = num_experts + foreign
    offs = torch.histc(flat.float(), bins=bins, min=0, max=bins).cumsum(0).to(torch.int32)[:num_experts]
    return torch.argsort(sort_keys(flat, bins), stable=True), offs


@dataclass(frozen=True)
class PairLayout:
    """The grouped GEMMs' rows of a step's token-expert pairs (sort_pairs' stable order): offs [E] int32 each local
    expert's cumulative row count; pos [P] int64 each pair's row; source [P] int64 each row's token; row_scales [P]
    float32 each row's token's activation scale."""

    offs: torch.Tensor
    pos: torch.Tensor
    source: torch.Tensor
    row_scales: torch.Tensor


def pair_layout_reference(top_i: torch.Tensor, num_experts: int, foreign: bool, token_scales: torch.Tensor
                          ) -> PairLayout:
    """top_i [T, k], token_scales [T] (or [T, 1]) -> the PairLayout, in torch: sort_pairs, then its inverse and each
    row's token and scale."""
    order, offs = sort_pairs(top_i, num_experts, foreign)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    source = order // top_i.shape[1]
    return PairLayout(offs, pos, source, token_scales.reshape(-1)[source])


def pair_layout_triton(top_i: torch.Tensor, num_experts: int, foreign: bool, token_scales: torch.Tensor
                       ) -> PairLayout:
    """pair_layout_reference in two launches (align_pairs_triton's count, then a stable scatter of each chunk's pairs
    that also writes their rows' tokens and scales and the experts' offsets), where torch takes about a dozen (the
    casts, histc, cumsum, a radix sort, arange, index_copy, the division and the gather). Same result."""
    flat = top_i.reshape(-1)
    num_pairs = flat.numel()
    num_bins = num_experts + foreign
    device = flat.device
    pos = torch.empty(num_pairs, dtype=torch.int64, device=device)
    source = torch.empty(num_pairs, dtype=torch.int64, device=device)
    row_scales = torch.empty(num_pairs, dtype=torch.float32, device=device)
    offs = torch.zeros(num_experts, dtype=torch.int32, device=device)
    if num_pairs:
        chunk, num_chunks, bins, counts = _count_chunks(flat, num_bins)
        _pair_layout_kernel[(num_chunks,)](
            flat, counts, token_scales.reshape(-1), offs, pos, source, row_scales, num_pairs, chunk, num_chunks,
            num_experts, TOP_K=top_i.shape[1], SUB=ALIGN_SUB, BINS=bins, CHUNK_TILE=32, num_warps=8,
        )
    return PairLayout(offs, pos, source, row_scales)


def sort_keys(expert_ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Expert ids (0..num_bins-1) in the narrowest integer type that holds them: a radix sort (CUB's, under
    torch.argsort on CUDA) makes a pass per key byte, so uint8 keys sort in one pass where int64 ones take eight."""
    if num_bins <= 256:
        return expert_ids.to(torch.uint8)
    return expert_ids.to(torch.int16 if num_bins <= 1 << 15 else torch.int32)


def align_pairs(top_i: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids (token * k + slot) grouped by expert in pair order, each group padded to a multiple of block_m
    with the id P (= number of pairs, an invalid row), and the expert of every block_m rows (num_experts:
    unused). num_experts counts every id top_i may hold (E + 1 with a bin for other ranks' pairs). Sizes
    depend only on P: the worst case P + num_experts * (block_m - 1) rows."""
    if on_triton(top_i):
        return align_pairs_triton(top_i, num_experts, block_m)
    return align_pairs_reference(top_i, num_experts, block_m)


@dataclass(frozen=True)
class Alignment:
    """align_pairs' result for blocks of block_m rows: sorted_ids [num_blocks * block_m] int32 (pair ids grouped by
    expert, each group padded with the id P), block_expert [num_blocks] int32."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def num_align_blocks(num_pairs: int, num_bins: int, block_m: int) -> int:
    """Blocks of block_m rows for num_pairs pairs over num_bins groups in the worst case (every group padded)."""
    return (num_pairs + num_bins * (block_m - 1) + block_m - 1) // block_m


def align_pairs_reference(top_i: torch.Tensor, num_bins: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = top_i.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(sort_keys(flat, num_bins), stable=True)
    counts = torch.histc(flat.float(), bins=num_bins, min=0, max=num_bins).to(torch.int64)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_expert]
    dest = (padded_end - padded)[sorted_expert] + rank
    num_blocks = num_align_blocks(num_pairs, num_bins, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.index_put_((dest,), order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert


def pair_chunks(num_pairs: int) -> tuple[int, int]:
    """(pairs a chunk, chunks): how the align and pair-layout kernels split a step's pairs, into about ALIGN_PROGRAMS
    chunks of a power of two pairs (ALIGN_SUB at least), one chunk at least."""
    chunk = max(ALIGN_SUB, triton.next_power_of_2(triton.cdiv(num_pairs, ALIGN_PROGRAMS)))
    return chunk, max(1, triton.cdiv(num_pairs, chunk))


def _count_chunks(flat: torch.Tensor, num_bins: int) -> tuple[int, int, int, torch.Tensor]:
    """(pairs a chunk, chunks, the bins rounded up to a power of two, counts [chunks, bins]: each chunk's pairs in
    each bin), the counts by one launch of _align_count_kernel."""
    chunk, num_chunks = pair_chunks(flat.numel())
    bins = triton.next_power_of_2(num_bins)
    counts = torch.empty(num_chunks, bins, dtype=torch.int32, device=flat.device)
    _align_count_kernel[(num_chunks,)](flat, counts, flat.numel(), chunk, SUB=ALIGN_SUB, BINS=bins, num_warps=8)
    return chunk, num_chunks, bins, counts


def align_pairs_triton(top_i: torch.Tensor, num_bins: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two kernels over chunks of pairs: per-chunk expert counts, then (each chunk again) the padded expert
    offsets from all counts, a stable scatter of the chunk's pairs, and its share of the padding rows and of
    block_expert. Same result as the reference."""
    flat = top_i.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = num_align_blocks(num_pairs, num_bins, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    chunk, num_chunks, bins_pow2, counts = _count_chunks(flat, num_bins)
    _align_scatter_kernel[(num_chunks,)](
        flat, counts, sorted_ids, block_expert, num_pairs, chunk, num_chunks, num_bins, num_blocks,
        triton.cdiv(num_blocks, num_chunks), BLOCK_M=block_m, SUB=ALIGN_SUB, BINS=bins_pow2, CHUNK_TILE=32, num_warps=8,
    )
    return sorted_ids, block_expert


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, w_ptr, i_ptr, stride_t, num_experts, lo, hi, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
        token = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < num_experts
        logits = tl.load(logits_ptr + token * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.exp(logits - tl.max(logits, axis=0))
        probs = e / tl.sum(e, axis=0)
        slots = tl.arange(0, TOP_K)
        top_w = tl.zeros([TOP_K], dtype=tl.float32)
        top_i = tl.zeros([TOP_K], dtype=tl.int32)
        left = tl.where(valid, logits, float("-inf"))  # chosen on the logits: the order softmax keeps
        for slot in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            idx = tl.min(tl.where(left == best, offs, BLOCK_E), axis=0)
            top_w = tl.where(slots == slot, tl.sum(tl.where(offs == idx, probs, 0.0), axis=0), top_w)
            top_i = tl.where(slots == slot, idx, top_i)
            left = tl.where(offs == idx, float("-inf"), left)
        top_w = top_w / tl.sum(top_w, axis=0)
        top_i = tl.where((top_i >= lo) & (top_i < hi), top_i - lo, hi - lo)
        tl.store(w_ptr + token * TOP_K + slots, top_w.to(w_ptr.dtype.element_ty))
        tl.store(i_ptr + token * TOP_K + slots, top_i.to(tl.int64))

    @triton.jit(do_not_specialize=["num_pairs", "chunk"])  # vary with the token count: one compile
    def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, chunk, SUB: tl.constexpr, BINS: tl.constexpr):
        pid = tl.program_id(0)
        bins = tl.arange(0, BINS)
        total = tl.zeros([BINS], dtype=tl.int32)
        for start in range(pid * chunk, pid * chunk + chunk, SUB):  # the last chunk is cut by the masks
            offs = start + tl.arange(0, SUB)
            expert = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
            total += tl.sum((expert[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + pid * BINS + bins, total)

    @triton.jit
    def _chunk_starts(counts_ptr, pid, num_chunks, BINS: tl.constexpr, CHUNK_TILE: tl.constexpr):
        """Every chunk's counts [num_chunks, BINS] -> (each expert's total, this chunk's start inside its group)."""
        bins = tl.arange(0, BINS)
        total = tl.zeros([BINS], dtype=tl.int32)
        before = tl.zeros([BINS], dtype=tl.int32)
        for c0 in range(0, num_chunks, CHUNK_TILE):
            rows = c0 + tl.arange(0, CHUNK_TILE)
            cnt = tl.load(counts_ptr + rows[:, None] * BINS + bins[None, :], mask=rows[:, None] < num_chunks, other=0)
            total += tl.sum(cnt, axis=0)
            before += tl.sum(tl.where(rows[:, None] < pid, cnt, 0), axis=0)
        return total, before

    @triton.jit(do_not_specialize=["num_pairs", "chunk", "num_chunks"])
    def _pair_layout_kernel(
        ids_ptr, counts_ptr, scales_ptr, offs_ptr, pos_ptr, source_ptr, row_scale_ptr, num_pairs, chunk, num_chunks,
        num_experts, TOP_K: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, CHUNK_TILE: tl.constexpr,
    ):
        """This chunk's pairs, stably, to their rows: pos[pair] = row, source[row] = token, row_scale[row] = its
        scale; the first program also writes the local experts' cumulative row counts."""
        pid = tl.program_id(0)
        bins = tl.arange(0, BINS)
        total, before = _chunk_starts(counts_ptr, pid, num_chunks, BINS, CHUNK_TILE)
        group_end = tl.cumsum(total, axis=0)
        tl.store(offs_ptr + bins, group_end, mask=(bins < num_experts) & (pid == 0))
        next_slot = group_end - total + before
        for start in range(pid * chunk, pid * chunk + chunk, SUB):  # the last chunk is cut by the masks
            pair = start + tl.arange(0, SUB)
            in_range = pair < num_pairs
            expert = tl.load(ids_ptr + pair, mask=in_range, other=-1).to(tl.int32)
            onehot = (expert[:, None] == bins[None, :]).to(tl.int32)
            row = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - onehot + next_slot[None, :]), axis=1)
            token = pair // TOP_K
            tl.store(pos_ptr + pair, row.to(tl.int64), mask=in_range)
            tl.store(source_ptr + row, token.to(tl.int64), mask=in_range)
            tl.store(row_scale_ptr + row, tl.load(scales_ptr + token, mask=in_range, other=0.0), mask=in_range)
            next_slot += tl.sum(onehot, axis=0)

    @triton.jit(do_not_specialize=["num_pairs", "chunk", "num_chunks", "num_blocks", "blocks_per_program"])
    def _align_scatter_kernel(
        ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr,
        num_pairs, chunk, num_chunks, num_bins, num_blocks, blocks_per_program,
        BLOCK_M: tl.constexpr, SUB: tl.constexpr, BINS: tl.constexpr, CHUNK_TILE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        bins = tl.arange(0, BINS)
        # Expert totals over all chunks, and this chunk's start inside each expert's group.
        total, before = _chunk_starts(counts_ptr, pid, num_chunks, BINS, CHUNK_TILE)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        group_end = tl.cumsum(padded, axis=0)
        group_start = group_end - padded
        # Stable scatter of this chunk's pairs: destination = group start + pairs of the expert before it.
        next_slot = group_start + before
        for start in range(pid * chunk, pid * chunk + chunk, SUB):  # the last chunk is cut by the masks
            offs = start + tl.arange(0, SUB)
            in_range = offs < num_pairs
            expert = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
            onehot = (expert[:, None] == bins[None, :]).to(tl.int32)
            rank = tl.cumsum(onehot, axis=0) - onehot + next_slot[None, :]
            dest = tl.sum(onehot * rank, axis=1)
            tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=in_range)
            next_slot += tl.sum(onehot, axis=0)
        # This program's blocks: their expert, and the id P on every row no pair fills.
        rows_in_block = tl.arange(0, BLOCK_M)
        for block in range(pid * blocks_per_program, pid * blocks_per_program + blocks_per_program):
            exists = block < num_blocks
            expert = tl.sum((group_end <= block * BLOCK_M).to(tl.int32), axis=0)
            tl.store(block_expert_ptr + block, tl.minimum(expert, num_bins), mask=exists)
            # Rows from the expert's start + count on are padding (a block past every group: no bin matches).
            first_pad = tl.sum(tl.where(bins == expert, group_start + total, 0), axis=0)
            row = block * BLOCK_M + rows_in_block
            pad = (row >= first_pad) | (expert >= num_bins)
            tl.store(sorted_ptr + row, tl.full([BLOCK_M], 0, tl.int32) + num_pairs, mask=pad & exists)
