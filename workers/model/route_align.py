"""The MoE router's top-k and the alignment of its token-expert pairs into expert-sorted blocks, as one Triton kernel
(moe_routing's route, align count and align scatter are three launches).

Every program routes a few tokens (softmax in float32, top-k chosen on the logits, ties to the lower expert id,
renormalised: moe_routing's numbers), counts its pairs per expert and ranks each pair among its own pairs of that
expert, then takes a ticket from a counter in device memory. The program that takes the last ticket has every count:
it lays the padded per-expert groups out, scatters all pairs (group start + the pairs of earlier programs for that
expert + the pair's own rank: the stable order moe_routing.align_pairs_reference gives), fills the padding and each
block's expert, and puts the counter back to zero for the next launch. This "last block" pattern needs no grid-wide
barrier and no launch order: see the threadFenceReduction sample of NVIDIA's CUDA samples
(https://github.com/NVIDIA/cuda-samples/tree/master/Samples/2_Concepts_and_Techniques/threadFenceReduction) and
CUTLASS's semaphore (a CTA barrier, then one thread's release at GPU scope:
https://github.com/NVIDIA/cutlass/blob/main/include/cutlass/semaphore.h). The last program's work is a few vector
passes over the pairs and blocks, so the kernel runs for steps of up to MAX_TOKENS tokens; longer (prefill) steps
take moe_routing's kernels, where the single program would be the long pole.

Sizes depend only on the token count and nothing is read back to the host: CUDA-graph safe. The counter is one int32
per device, zeroed once (first use, before any graph capture: the engine's warm-up runs every step size first).
"""

from __future__ import annotations

import torch

from workers.model import moe_routing
from workers.model.moe_routing import Alignment

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_TOKENS = 512  # steps up to this many tokens route and align in one launch (the last program's tiles stay small)
PAIRS_PER_PROGRAM = 64  # token-expert pairs one program routes and ranks
PAIR_TILE = 1024  # pairs the last program scatters a pass
BLOCK_TILE = 64  # blocks the last program fills a pass
# False: moe_routing's three launches, as before this kernel; and for long steps' grouped FP8 experts, the pairs'
# rows laid out by torch's sort and index ops rather than moe_routing.pair_layout_triton's two launches.
# Off: measured with route_align's and norm_quant's kernels together (benchmarks/README.md, run89-90, one H200), they
# took 192 launches out of a batch-256 decode step and none of its GPU time, and an 8k-token prefill step went from
# 92.8 to 94.9 ms. Small decode batches, where a launch's fixed cost weighs most, are not measured yet
# (bench_engine --layer-fusions both --decode-batches ...). bench_engine --layer-fusions on|both sets it.
# Since then norm_quant's kernel has changed (its FUSED says how); on or off is for --layer-fusions both to decide,
# on a GPU, before the default changes.
FUSED = False

_COUNTERS: dict[torch.device, torch.Tensor] = {}  # the ticket counter of each device, 0 between launches


def supports(logits: torch.Tensor, top_k: int) -> bool:
    """Whether the one-launch kernel runs: Triton on these logits' device, a power-of-two k and a decode-sized step."""
    return (FUSED and moe_routing.on_triton(logits) and top_k & (top_k - 1) == 0 and top_k <= PAIRS_PER_PROGRAM
            and logits.shape[0] <= MAX_TOKENS)


def route_align_reference(logits: torch.Tensor, top_k: int, lo: int, hi: int, num_bins: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """moe_routing's torch route then align: what the kernel computes in one launch."""
    top_w, top_i = moe_routing.route_reference(logits, top_k, lo, hi)
    return top_w, top_i, Alignment(*moe_routing.align_pairs_reference(top_i, num_bins, block_m), block_m)


def route_and_align(logits: torch.Tensor, top_k: int, expert_range: tuple[int, int] | None, num_bins: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """moe_routing.route and align_pairs of its ids in blocks of block_m: one launch where supports() says so, else
    moe_routing's kernels (or its torch references off CUDA)."""
    lo, hi = expert_range or (0, logits.shape[1])
    if supports(logits, top_k):
        return route_align(logits, top_k, lo, hi, num_bins, block_m)
    top_w, top_i = moe_routing.route(logits, top_k, expert_range)
    return top_w, top_i, Alignment(*moe_routing.align_pairs(top_i, num_bins, block_m), block_m)


def _counter(device: torch.device) -> torch.Tensor:
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def route_align(logits: torch.Tensor, top_k: int, lo: int, hi: int, num_bins: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """logits [T, E] -> (weights [T, k] in logits.dtype, expert ids [T, k] int64 local to [lo, hi) (hi - lo: another
    rank's), their Alignment in blocks of block_m over num_bins bins) in one launch (supports() says when)."""
    tokens, num_experts = logits.shape
    device = logits.device
    top_w = logits.new_empty(tokens, top_k)
    top_i = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    num_pairs = tokens * top_k
    num_blocks = moe_routing.num_align_blocks(num_pairs, num_bins, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if tokens:
        per_program = max(1, PAIRS_PER_PROGRAM // top_k)
        programs = triton.cdiv(tokens, per_program)
        bins = triton.next_power_of_2(num_bins)
        ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
        counts = torch.empty(programs, bins, dtype=torch.int32, device=device)
        bases = torch.empty(programs, bins, dtype=torch.int32, device=device)
        _route_align_kernel[(programs,)](
            logits, top_w, top_i, ranks, counts, bases, _counter(device), sorted_ids, block_expert,
            tokens, logits.stride(0), num_experts, lo, hi, num_bins, num_blocks, programs,
            TOP_K=top_k, BLOCK_E=triton.next_power_of_2(num_experts), TOKENS=per_program, BINS=bins,
            BLOCK_M=block_m, PROGRAMS=triton.next_power_of_2(programs), PAIR_TILE=PAIR_TILE, BLOCK_TILE=BLOCK_TILE,
            num_warps=4 if bins <= 128 else 8,
        )
    return top_w, top_i, Alignment(sorted_ids, block_expert, block_m)


if triton is not None:

    @triton.jit
    def _route_tokens(logits_ptr, tok, t_mask, stride_t, num_experts, lo, hi,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, TOKENS: tl.constexpr):
        """Top-k of each token's row of logits: (renormalised float32 weights, local expert ids) [TOKENS, TOP_K]."""
        offs = tl.arange(0, BLOCK_E)
        valid = offs < num_experts
        logits = tl.load(logits_ptr + tok.to(tl.int64)[:, None] * stride_t + offs[None, :],
                         mask=t_mask[:, None] & valid[None, :], other=0.0).to(tl.float32)
        left = tl.where(valid[None, :], logits, float("-inf"))  # chosen on the logits: the order softmax keeps
        e = tl.exp(left - tl.max(left, axis=1)[:, None])
        probs = e / tl.sum(e, axis=1)[:, None]
        slots = tl.arange(0, TOP_K)[None, :]
        top_w = tl.zeros([TOKENS, TOP_K], dtype=tl.float32)
        top_i = tl.zeros([TOKENS, TOP_K], dtype=tl.int32)
        for slot in tl.static_range(TOP_K):
            best = tl.max(left, axis=1)
            idx = tl.min(tl.where(left == best[:, None], offs[None, :], BLOCK_E), axis=1)
            chosen = offs[None, :] == idx[:, None]
            top_w = tl.where(slots == slot, tl.sum(tl.where(chosen, probs, 0.0), axis=1)[:, None], top_w)
            top_i = tl.where(slots == slot, idx[:, None], top_i)
            left = tl.where(chosen, float("-inf"), left)
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        return top_w, tl.where((top_i >= lo) & (top_i < hi), top_i - lo, hi - lo)

    @triton.jit
    def _lay_out(counts_ptr, bases_ptr, num_programs, BLOCK_M: tl.constexpr, BINS: tl.constexpr,
                 PROGRAMS: tl.constexpr):
        """The last program: every program's counts -> each (program, expert)'s first row in bases; returns the
        groups' padded ends and starts, and the experts' pair counts [BINS]."""
        progs = tl.arange(0, PROGRAMS)
        bins = tl.arange(0, BINS)
        offs = progs[:, None] * BINS + bins[None, :]
        cnt = tl.load(counts_ptr + offs, mask=progs[:, None] < num_programs, other=0, cache_modifier=".cg")
        total = tl.sum(cnt, axis=0)
        padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        group_end = tl.cumsum(padded, axis=0)
        group_start = group_end - padded
        tl.store(bases_ptr + offs, group_start[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=progs[:, None] < num_programs)
        return group_end, group_start, total

    @triton.jit
    def _scatter_pairs(i_ptr, rank_ptr, bases_ptr, sorted_ptr, num_pairs, PAIRS: tl.constexpr, BINS: tl.constexpr,
                       PAIR_TILE: tl.constexpr):
        """The last program: every pair's row = its (program, expert)'s first row + its rank there."""
        for start in range(0, num_pairs, PAIR_TILE):
            pair = start + tl.arange(0, PAIR_TILE)
            mask = pair < num_pairs
            expert = tl.load(i_ptr + pair, mask=mask, other=0, cache_modifier=".cg").to(tl.int32)
            rank = tl.load(rank_ptr + pair, mask=mask, other=0, cache_modifier=".cg")
            base = tl.load(bases_ptr + (pair // PAIRS) * BINS + expert, mask=mask, other=0, cache_modifier=".cg")
            tl.store(sorted_ptr + base + rank, pair, mask=mask)

    @triton.jit
    def _fill_blocks(sorted_ptr, block_expert_ptr, group_end, group_start, total, num_pairs, num_bins, num_blocks,
                     BLOCK_M: tl.constexpr, BINS: tl.constexpr, BLOCK_TILE: tl.constexpr):
        """The last program: each block's expert (num_bins past every group) and the id num_pairs on its padding."""
        bins = tl.arange(0, BINS)
        rows_in_block = tl.arange(0, BLOCK_M)
        for start in range(0, num_blocks, BLOCK_TILE):
            block = start + tl.arange(0, BLOCK_TILE)
            exists = block < num_blocks
            expert = tl.sum((group_end[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + block, tl.minimum(expert, num_bins), mask=exists)
            first_pad = tl.sum(tl.where(bins[None, :] == expert[:, None], (group_start + total)[None, :], 0), axis=1)
            row = block[:, None] * BLOCK_M + rows_in_block[None, :]
            pad = (row >= first_pad[:, None]) | (expert[:, None] >= num_bins)
            tl.store(sorted_ptr + row, tl.zeros([BLOCK_TILE, BLOCK_M], tl.int32) + num_pairs, mask=pad & exists[:, None])

    @triton.jit(do_not_specialize=["num_tokens", "num_blocks", "num_programs"])
    def _route_align_kernel(
        logits_ptr, w_ptr, i_ptr, rank_ptr, counts_ptr, bases_ptr, counter_ptr, sorted_ptr, block_expert_ptr,
        num_tokens, stride_t, num_experts, lo, hi, num_bins, num_blocks, num_programs,
        TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, TOKENS: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr,
        PROGRAMS: tl.constexpr, PAIR_TILE: tl.constexpr, BLOCK_TILE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tok = pid * TOKENS + tl.arange(0, TOKENS)
        t_mask = tok < num_tokens
        top_w, top_i = _route_tokens(logits_ptr, tok, t_mask, stride_t, num_experts, lo, hi, TOP_K, BLOCK_E, TOKENS)
        out = tok.to(tl.int64)[:, None] * TOP_K + tl.arange(0, TOP_K)[None, :]
        tl.store(w_ptr + out, top_w.to(w_ptr.dtype.element_ty), mask=t_mask[:, None])
        tl.store(i_ptr + out, top_i.to(tl.int64), mask=t_mask[:, None])
        # this program's pairs in pair order: counts per expert, and each pair's rank among its expert's pairs here
        PAIRS: tl.constexpr = TOKENS * TOP_K
        experts = tl.reshape(tl.where(t_mask[:, None], top_i, -1), (PAIRS,))
        onehot = (experts[:, None] == tl.arange(0, BINS)[None, :]).to(tl.int32)
        rank = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - onehot), axis=1)
        pair = pid * PAIRS + tl.arange(0, PAIRS)
        tl.store(rank_ptr + pair, rank, mask=pair < num_tokens * TOP_K)
        tl.store(counts_ptr + pid * BINS + tl.arange(0, BINS), tl.sum(onehot, axis=0))
        tl.debug_barrier()  # every thread's stores before the ticket, which releases them at GPU scope
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == num_programs - 1:  # the last program: every count is in
            tl.debug_barrier()
            group_end, group_start, total = _lay_out(counts_ptr, bases_ptr, num_programs, BLOCK_M, BINS, PROGRAMS)
            tl.debug_barrier()  # bases stored by every thread before any reads them back
            _scatter_pairs(i_ptr, rank_ptr, bases_ptr, sorted_ptr, num_tokens * TOP_K, PAIRS, BINS, PAIR_TILE)
            _fill_blocks(sorted_ptr, block_expert_ptr, group_end, group_start, total, num_tokens * TOP_K, num_bins,
                         num_blocks, BLOCK_M, BINS, BLOCK_TILE)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
