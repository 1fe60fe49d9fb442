"""Paged decode attention in Triton: one query row per sequence against its KV blocks, no Python loop.

A program computes all query heads of one KV head's group for one split of one sequence's context
(flash-decoding: at small batch the context is split so that the GPU has enough programs, and a small
kernel merges the splits). The split count depends only on the batch size: CUDA-graph safe.
An FP8 cache's rows are widened exactly for the dot products (see dot_dtype); the K scale is folded into the softmax
scale, the V scale into the output (both a per-tensor factor that commutes with the dot products).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


class DecodeTiles(NamedTuple):
    """Launch shape: block_n context tokens per inner iteration. heads_adjacent: a sequence's KV heads in adjacent
    programs (the grid's fastest axis), so the programs running together read whole cache rows (a token's KV heads
    are adjacent in a row: 4 x 128 bytes of FP8 at the 30B's shape); else the sequences are the fastest axis and the
    programs running together read one head's 128-byte piece of many sequences' rows. v_pairs: an FP8 cache's V
    tiles read as int16 pairs and widened before the P @ V operand's layout (the note after FP8_DOT_DTYPE)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    heads_adjacent: bool = False
    v_pairs: bool = True


DECODE_TILES = DecodeTiles()
# An FP8 cache's tile of 64 tokens is half the bytes of a bf16 one, and the loop is bound by each iteration's
# latency, not by bandwidth (run62: batch 256 x 1,024 tokens, 137.8 us a layer over FP8 against 134.8 over bf16).
# 128 tokens an iteration (bench_attention run63, us a layer, 64 -> 128): batch 256 x 1,024 138.1 -> 126.9,
# batch 64 x 1,800 76.1 -> 63.4, batch 1 x 1,800 6.7 -> 7.8 (bf16 cache: 132.7, 74.4, 6.4).
# Three stages once V is read in pairs (run149 and run152, H100, us a layer, two stages -> three): batch 256 x 1,024
# 116.2/115.9 -> 111.6/110.8, batch 64 x 1,800 63.2/62.0 -> 60.3/58.9, batch 1 x 1,800 7.44/7.43 -> 7.30/7.29.
FP8_DECODE_TILES = DecodeTiles(block_n=128, num_stages=3)
MAX_SPLITS = 32
# What an FP8 cache's rows are widened to for the dot products when q is 16-bit (q is converted to the same dtype).
# float16: every e4m3 value is a float16 value (4 exponent and 3 mantissa bits fit 5 and 10), and sm89+ widens two
# in one instruction (PTX cvt.rn.f16x2.e4m3x2). Widening to bfloat16 goes through float16 and float32, three
# conversions per two values, which left the FP8 decode kernel slower than reading bf16 rows (run50). bfloat16 q
# values are float16 values too (between 2^-14 and 65,504 in magnitude, far wider than q/k-normed heads), so the
# one rounding added is the probabilities' before the PV product, to float16's 11 bits instead of bfloat16's 8.
# run62 (H200, us a layer, widened to bf16 -> f16): decode batch 256 x 1,024 154.6 -> 137.8, batch 64 x 1,800
# 86.7 -> 76.7; prefill of four 2,048-token chunks continuing 2,048-token contexts 1,807 -> 1,577.
# None: q's dtype (the widening of earlier passes, kept for side-by-side benchmarks).
FP8_DOT_DTYPE: torch.dtype | None = torch.float16
# An FP8 V tile is widened before the P @ V dot's operand layout, not after it. That dot reduces over the tile's
# tokens, which are rows of the cache (a token's head_dim values are adjacent), and an mma operand holds pairs of
# adjacent reduction indices in a register. For 16-bit data the transposing shared-memory load (ldmatrix.trans)
# gathers them; for 8-bit data there is none, and Triton moves the FP8 tile into the operand layout before widening
# it (it moves the narrower type), a byte a load: 128 LDS.U8 a thread a tile at the default FP8 tiles, 208
# registers. Read as int16 pairs, each byte widened and the two halves joined, the conversion happens in the load's
# layout (a join is not an elementwise op, so the layout change cannot move above it) and the float16 tile reaches
# the operand through 16 LDSM.16.MT88.4: no LDS.U8, 150 registers, 2,144 -> 1,904 instructions (sm_90 builds,
# tests/test_sm90_builds.py). The GPU's time for it: not yet measured.


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    head_dim = q.shape[-1]
    return (
        triton is not None
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and q.shape[1] % k_cache.shape[2] == 0
    )


def dot_dtype(q: torch.Tensor, k_cache: torch.Tensor, widen_to: torch.dtype | None = None):
    """The Triton dtype the kernels' dot products take: q's, or for an FP8 cache and 16-bit q widen_to (default
    FP8_DOT_DTYPE)."""
    target = q.dtype
    if k_cache.dtype.itemsize == 1 and q.dtype in (torch.float16, torch.bfloat16):
        target = widen_to or FP8_DOT_DTYPE or q.dtype
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[target]


def v_pairs(v_cache: torch.Tensor) -> bool:
    """Whether the decode kernel can widen FP8 V tiles from int16 pairs (the note after FP8_DOT_DTYPE): an FP8 cache
    whose rows start at even bytes."""
    even = v_cache.data_ptr() % 2 == 0 and all(stride % 2 == 0 for stride in v_cache.stride()[:3])
    return v_cache.dtype.itemsize == 1 and even


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Context splits per (sequence, KV head): the fewest (a power of two, at most MAX_SPLITS) that give
    at least one program per SM."""
    splits = 1
    while splits < MAX_SPLITS and batch * kv_heads * splits < num_sms:
        splits *= 2
    return splits


if triton is not None:

    @triton.jit
    def load_v_tile(v_ptr, rows, row_ok, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, PAIRS: tl.constexpr):
        """A tile of V rows (cache offsets `rows`, masked by row_ok) in DTYPE, for the P @ V dot. PAIRS: an FP8
        cache's rows read as int16 pairs, each byte widened and the halves joined (the note after FP8_DOT_DTYPE)."""
        if PAIRS:
            offs_h = tl.arange(0, HEAD_DIM // 2)
            pairs = tl.load(v_ptr.to(tl.pointer_type(tl.int16)) + (rows // 2)[:, None] + offs_h[None, :],
                            mask=row_ok[:, None], other=0)
            even = (pairs & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
            odd = (pairs >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
            return tl.reshape(tl.join(even, odd), (rows.shape[0], HEAD_DIM))
        else:
            return tl.load(v_ptr + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], mask=row_ok[:, None],
                           other=0.0).to(DTYPE)

    @triton.jit(do_not_specialize=["stride_tb"])  # the block-table width varies step to step: one compile
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, lens_ptr, scale, v_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_tb,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
        HEADS_ADJACENT: tl.constexpr, V_PAIRS: tl.constexpr,
    ):
        if HEADS_ADJACENT:  # grid (kv_heads, batch, splits)
            kv_head = tl.program_id(0)
            seq = tl.program_id(1)
            kv_heads = tl.num_programs(0)
        else:  # grid (batch, kv_heads, splits)
            seq = tl.program_id(0)
            kv_head = tl.program_id(1)
            kv_heads = tl.num_programs(1)
        split = tl.program_id(2)
        ctx = tl.load(lens_ptr + seq)
        # Splits of whole BLOCK_N tiles; the last ones may be empty for short contexts.
        span = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * span
        hi = tl.minimum(ctx, lo + span)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0
        ).to(DOT_DTYPE)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            block = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            rows = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0).to(q.dtype)
            v = load_v_tile(v_ptr, rows, n_mask, HEAD_DIM, q.dtype, V_PAIRS)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        acc = acc * v_scale
        if NUM_SPLITS == 1:
            tl.store(
                o_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=g_mask[:, None],
            )
        else:  # unnormalised partials [B, heads, NUM_SPLITS, HEAD_DIM] and (max, sum) [B, heads, NUM_SPLITS, 2]
            part = (seq * kv_heads * GROUP + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
            tl.store(part_ml_ptr + part * 2, m, mask=g_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_mask)

    @triton.jit
    def _merge_kernel(
        part_acc_ptr, part_ml_ptr, o_ptr, stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
        m = tl.load(part_ml_ptr + part * 2)
        l = tl.load(part_ml_ptr + part * 2 + 1)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])
        m_all = tl.max(m, 0)  # split 0 is never empty (context >= 1), so this is finite
        w = tl.exp(m - m_all)  # empty splits: exp(-inf) = 0
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


def kernel_constants(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: DecodeTiles, splits: int,
                     widen_to: torch.dtype | None = None) -> dict:
    """_decode_kernel's compile-time arguments and launch options for these tensors (decode_attention's, and what
    lab/kernels/sm90_compile builds)."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    return dict(
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=tiles.block_n, NUM_SPLITS=splits, DOT_DTYPE=dot_dtype(q, k_cache, widen_to),
        HEADS_ADJACENT=tiles.heads_adjacent, V_PAIRS=tiles.v_pairs and v_pairs(v_cache),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    widen_to: torch.dtype | None = None,
    tiles: DecodeTiles | None = None,
) -> None:
    """q/out [B, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim] (same strides; q's dtype
    or FP8, read as cache * k_scale / v_scale); block_tables [B, W] int32; context_lens [B] int32 (>= 1, the
    query's own row included). splits: context splits per sequence (a power of two; default num_splits for this
    device). widen_to: an FP8 cache's dot dtype (default FP8_DOT_DTYPE). tiles: default FP8_DECODE_TILES for an
    FP8 cache, else DECODE_TILES."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention needs contiguous head_dim and K/V caches of equal strides")
    if splits is None:
        splits = num_splits(batch, kv_heads, _num_sms(q.device.index)) if q.is_cuda else 1
    if splits & (splits - 1):
        raise ValueError(f"splits={splits} is not a power of two")
    tiles = tiles or (FP8_DECODE_TILES if k_cache.dtype.itemsize == 1 else DECODE_TILES)
    part_acc = part_ml = out  # unused by the kernel when there is a single split
    if splits > 1:
        part_acc = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)
    grid = (kv_heads, batch, splits) if tiles.heads_adjacent else (batch, kv_heads, splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, context_lens, scale * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        **kernel_constants(q, k_cache, v_cache, tiles, splits, widen_to),
    )
    if splits > 1:
        _merge_kernel[(batch, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim, NUM_SPLITS=splits, num_warps=4,
        )
