"""Paged decode attention in Triton: one query row per sequence against its KV blocks, no Python loop.

One program per (sequence, KV head) computes all query heads of that KV head's group with an online
softmax over the context, reading K/V rows through the block table. CUDA-graph safe (lengths are read
on the device). Unavailable without Triton or on the CPU; `supports` says when it can run.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_N = 64  # context tokens per inner iteration


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


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_tb,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        ctx = tl.load(lens_ptr + seq)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, ctx, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < ctx
            block = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            rows = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / l[:, None]
        tl.store(
            o_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None],
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """q/out [B, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim] (same strides);
    block_tables [B, W] int32; context_lens [B] int32 (>= 1, the query's own row included)."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("decode_attention needs contiguous head_dim and K/V caches of equal strides")
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, num_warps=4, num_stages=2,
    )
