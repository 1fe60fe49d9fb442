"""Varlen paged prefill attention in Triton: every multi-row chunk of a step in one kernel launch.

A program owns BLOCK_Q query rows of one chunk for all query heads of one KV head (GQA rows packed
into the tile's M dimension), reads K/V through the block table with an online softmax in float32. On devices
with TMA, chunks that are whole prompts read this step's contiguous K/V rows through tensor descriptors instead.
An FP8 cache's rows are widened exactly for the dot products (paged_decode.dot_dtype: float16 by default, q converted
to it), with the K scale folded into the softmax scale and the V scale into the output; chunks reading this step's
own rows (in the activation dtype) use neither.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from workers.model.paged_decode import dot_dtype, triton

if triton is not None:
    import triton.language as tl

LOG2_E = 1.4426950408889634


class TileConfig(NamedTuple):
    """Launch shape: block_m packed (row, head) pairs per program, block_n keys per inner iteration."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2  # with pointer loads 3-6% faster than 3 stages on every step shape (run8, run31)
    # A chunk that is a whole prompt (its context is its own rows) reads its keys and values from this step's
    # contiguous K/V through TMA descriptors instead of gathering them from the paged cache.
    fresh_tma: bool = False


POINTER_TILES = TileConfig()  # any GPU Triton runs on
# Devices with TMA (compute capability 9+). bench_attention run36, H200: the 8k catalogue step (a continued chunk,
# whole prompts) 464 -> 399 us, four 2,048-token prompts 547 -> 464 us. At 2 stages TMA loads gain nothing (479 us).
TMA_TILES = TileConfig(num_stages=3, fresh_tma=True)
# Over an FP8 cache (bench_attention run63, H200): 128 keys an iteration. Four 2,048-token chunks continuing
# 2,048-token contexts 1,691 -> 1,471 us (bf16 cache 1,464); the catalogue step, mostly whole prompts read from the
# fresh rows, 427 -> 436 us (bf16 cache 400).
FP8_TMA_TILES = TileConfig(block_n=128, num_stages=3, fresh_tma=True)
DEFAULT_TILES: TileConfig | None = None  # None: (FP8_)TMA_TILES where the device has TMA, else POINTER_TILES


def default_tiles(device: torch.device, fp8_cache: bool = False) -> TileConfig:
    if DEFAULT_TILES is not None:
        return DEFAULT_TILES
    if device.type == "cuda" and _has_tma(device.index):
        return FP8_TMA_TILES if fp8_cache else TMA_TILES
    return POINTER_TILES


@functools.cache
def _has_tma(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


if triton is not None:

    @triton.jit
    def _online_softmax(acc, l, m, s, v, offs_n, end, q_pos, qk_scale, CAUSAL_MASK: tl.constexpr):
        """One BLOCK_N tile of keys into the running (acc, l, m): scores s = q k^T, values v. Keys at or past `end`
        (and, with CAUSAL_MASK, after each row) are hidden; log2 domain, the scale applied in the exponent's FMA
        (qk_scale > 0 keeps the max the max)."""
        if CAUSAL_MASK:
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & (offs_n < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l * alpha + tl.sum(p, 1), m_new

    @triton.jit
    def _attend(
        acc, l, m, q, k_ptr, v_ptr, table_ptr, kv_head, start, end, q_pos, qk_scale,
        stride_cb, stride_cs, stride_ch,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    ):
        """Online softmax over keys start..end-1 (end exclusive); CAUSAL_MASK hides keys after each row."""
        offs_d = tl.arange(0, HEAD_DIM)
        for first in range(start, end, BLOCK_N):
            offs_n = first + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            rows = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            k_t = tl.load(k_ptr + rows[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(q.dtype)
            acc, l, m = _online_softmax(acc, l, m, tl.dot(q, k_t), v, offs_n, end, q_pos, qk_scale, CAUSAL_MASK)
        return acc, l, m

    @triton.jit
    def _attend_paged(
        acc, l, m, q, k_ptr, v_ptr, table_ptr, kv_head, full_end, kv_end, q_pos, qk_scale,
        stride_cb, stride_cs, stride_ch,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """A tile's keys from the paged cache: those every row sees unmasked, then the causal tail."""
        acc, l, m = _attend(
            acc, l, m, q, k_ptr, v_ptr, table_ptr, kv_head, 0, full_end, q_pos, qk_scale,
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, BLOCK_N, False,
        )
        return _attend(
            acc, l, m, q, k_ptr, v_ptr, table_ptr, kv_head, full_end, kv_end, q_pos, qk_scale,
            stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True,
        )

    @triton.jit
    def _attend_fresh(
        acc, l, m, q, k_desc, v_desc, key_row0, col, start, end, q_pos, qk_scale,
        BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
    ):
        """_attend for a chunk that is a whole prompt: key j is row key_row0 + j of this step's K/V ([T, kv_heads *
        head_dim], read as [BLOCK_N, head_dim] tiles at column col). Rows past `end` belong to the next chunk (or
        read as zeros past the step): the causal mask hides them, and their zero weights keep their values out."""
        for first in range(start, end, BLOCK_N):
            offs_n = first + tl.arange(0, BLOCK_N)
            k = k_desc.load([key_row0 + first, col])
            v = v_desc.load([key_row0 + first, col])
            acc, l, m = _online_softmax(acc, l, m, tl.dot(q, tl.trans(k)), v, offs_n, end, q_pos, qk_scale, CAUSAL_MASK)
        return acc, l, m

    # Vary per step: one compile. The table pointers are slices past the step's decodes (their alignment varies).
    @triton.jit(do_not_specialize=["tables_ptr", "starts_ptr", "lens_ptr", "num_seqs", "first_tile", "stride_tb"])
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, k_desc, v_desc, o_ptr, tables_ptr, starts_ptr, lens_ptr, qk_scale, k_scale, v_scale,
        num_seqs, first_tile,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_tb,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, FRESH_TMA: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        # Tiles in reverse: the last rows of each chunk (the most keys) are scheduled first.
        tile = tl.num_programs(1) - 1 - tl.program_id(1)
        # Chunk s owns tiles from starts[s] // BLOCK_Q + s - first_tile on (at least ceil(rows / BLOCK_Q) of them).
        lo = tl.zeros([], tl.int32)
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            owns = tl.load(starts_ptr + mid) // BLOCK_Q + mid - first_tile <= tile
            lo = tl.where(owns, mid, lo)
            hi = tl.where(owns, hi, mid)
        seq = lo
        q_start = tl.load(starts_ptr + seq)
        n = tl.load(starts_ptr + seq + 1) - q_start
        ctx = tl.load(lens_ptr + seq)
        row0 = (tile - (q_start // BLOCK_Q + seq - first_tile)) * BLOCK_Q
        if row0 < n:
            offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
            offs_d = tl.arange(0, HEAD_DIM)
            r = row0 + offs_m // GROUP_PAD
            h = offs_m % GROUP_PAD
            row_ok = (r < n) & (h < GROUP)
            heads = kv_head * GROUP + h
            q = tl.load(
                q_ptr + (q_start + r)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0,
            )
            q_pos = ctx - n + r  # causal aligned to the end of the context: row j sees keys 0..ctx-n+j
            table_ptr = tables_ptr + seq * stride_tb
            m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
            # Keys every row of the tile sees need no mask; the tail up to the tile's last row does.
            full_end = (ctx - n + row0 + 1) // BLOCK_N * BLOCK_N
            kv_end = ctx - n + tl.minimum(row0 + BLOCK_Q, n)
            paged_scale = qk_scale * k_scale
            v_mult = v_scale
            if FRESH_TMA:  # a compile-time branch: without FRESH_TMA the descriptors are plain pointers
                if ctx == n:
                    col = kv_head * HEAD_DIM
                    acc, l, m = _attend_fresh(acc, l, m, q, k_desc, v_desc, q_start, col, 0, full_end, q_pos,
                                              qk_scale, BLOCK_N, False)
                    acc, l, m = _attend_fresh(acc, l, m, q, k_desc, v_desc, q_start, col, full_end, kv_end, q_pos,
                                              qk_scale, BLOCK_N, True)
                else:
                    acc, l, m = _attend_paged(acc, l, m, q.to(DOT_DTYPE), k_ptr, v_ptr, table_ptr, kv_head, full_end,
                                              kv_end, q_pos, paged_scale, stride_cb, stride_cs, stride_ch, BLOCK_SIZE,
                                              HEAD_DIM, BLOCK_N)
                v_mult = tl.where(ctx == n, 1.0, v_scale)
            else:
                acc, l, m = _attend_paged(acc, l, m, q.to(DOT_DTYPE), k_ptr, v_ptr, table_ptr, kv_head, full_end, kv_end,
                                          q_pos, paged_scale, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, HEAD_DIM,
                                          BLOCK_N)
            out = acc * v_mult / l[:, None]
            tl.store(
                o_ptr + (q_start + r)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None],
            )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    first_row: int,
    last_row: int,
    scale: float,
    out: torch.Tensor,
    tiles: TileConfig | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    widen_to: torch.dtype | None = None,
) -> None:
    """Attention of chunks 0..S-1, rows first_row..last_row-1 of q/out [T, heads, head_dim]: chunk s is rows
    query_starts[s]:query_starts[s+1] ([S + 1] int32, device; query_starts[0] = first_row) whose context
    (its own rows included, already in the caches) is context_lens[s] tokens in blocks block_tables[s].
    k_new/v_new: this step's K/V rows [T, kv_heads, head_dim] (the rows of q), which tiles.fresh_tma reads for
    chunks that are whole prompts when they are contiguous (else every chunk reads the paged cache).
    Caches in q's dtype or FP8 (read as cache * k_scale / v_scale; widen_to: their dot dtype, default
    paged_decode.FP8_DOT_DTYPE). tiles: default default_tiles(q.device, FP8 cache or not)."""
    tiles = tiles or default_tiles(q.device, k_cache.dtype.itemsize == 1)
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("prefill_attention needs contiguous head_dim and K/V caches of equal strides")
    if group_pad > tiles.block_m:
        raise ValueError(f"{group} query heads per KV head do not fit block_m={tiles.block_m}")
    block_q = tiles.block_m // group_pad
    num_seqs = query_starts.shape[0] - 1
    first_tile = first_row // block_q
    num_tiles = last_row // block_q + num_seqs - first_tile
    fresh_tma = tiles.fresh_tma and all(t is not None and t.is_contiguous() for t in (k_new, v_new))
    k_desc = v_desc = k_cache  # unused unless fresh_tma
    if fresh_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc, v_desc = (TensorDescriptor.from_tensor(t.view(t.shape[0], -1), [tiles.block_n, head_dim])
                          for t in (k_new, v_new))
    _prefill_kernel[(kv_heads, num_tiles)](
        q, k_cache, v_cache, k_desc, v_desc, out, block_tables, query_starts, context_lens, scale * LOG2_E, k_scale, v_scale,
        num_seqs, first_tile,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_Q=block_q, BLOCK_N=tiles.block_n, FRESH_TMA=fresh_tma, DOT_DTYPE=dot_dtype(q, k_cache, widen_to),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
