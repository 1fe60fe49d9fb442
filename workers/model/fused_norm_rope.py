"""Triton kernels for the text tower's elementwise chains: RMSNorm, residual add + RMSNorm, and the per-head
q/k RMSNorm + MRoPE that also writes this step's K/V into the paged cache. One launch replaces 6-20 torch ops.

Each rounds where transformers rounds (norm in float32, cast, weight multiply in the activation dtype; RoPE
products and their sum each rounded to the activation dtype). The torch references are rms_norm_reference here
and layers.py's and text.py's paths; `supports` says when a kernel can run (Triton present, CUDA tensors). Into an
FP8 cache the K/V write stores what kv_cache.quantize_fp8 stores, bit for bit.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch, as transformers' Qwen3 computes it (float32 statistics, the product in the input's dtype):
    the reference of the fused kernels here and in norm_quant.py."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


HEADS_PER_PROGRAM = 4  # q/k heads one program of the q/k kernel normalises and rotates


def supports(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:

    @triton.jit
    def _norm_row(s, w_ptr, offs, mask, n, eps):
        """RMSNorm of one row held in registers (activation dtype), as transformers computes it."""
        x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        normed = (x * rstd).to(s.dtype)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        return (w.to(tl.float32) * normed.to(tl.float32)).to(s.dtype)

    @triton.jit
    def _load_row_sum(x_ptr, r_ptr, res_out_ptr, row, offs, mask, stride_x, stride_r, stride_ro,
                      HAS_RESIDUAL: tl.constexpr):
        """Row `row` of x, plus its residual row when HAS_RESIDUAL (the sum rounded to the activation dtype before
        the norm reads it, and stored to res_out)."""
        s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
            s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
            tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        return s

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
                         stride_x, stride_r, stride_o, stride_ro, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        s = _load_row_sum(x_ptr, r_ptr, res_out_ptr, row, offs, mask, stride_x, stride_r, stride_ro, HAS_RESIDUAL)
        tl.store(out_ptr + row * stride_o + offs, _norm_row(s, w_ptr, offs, mask, n, eps), mask=mask)

    @triton.jit
    def _norm_rope_heads(src, h_mask, w_ptr, cos_row, sin_row, eps, HEAD_DIM: tl.constexpr):
        """Per-head RMSNorm then RoPE of a [heads, head_dim] tile read as two halves; returns the two halves.
        x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1): each product rounded, then the sum."""
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)[None, :]
        x1 = tl.load(src + d, mask=h_mask, other=0.0)
        x2 = tl.load(src + HALF + d, mask=h_mask, other=0.0)
        dtype = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)[:, None]
        n1 = (tl.load(w_ptr + d).to(tl.float32) * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        n2 = (tl.load(w_ptr + HALF + d).to(tl.float32) * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        c1 = tl.load(cos_row + d).to(tl.float32)
        c2 = tl.load(cos_row + HALF + d).to(tl.float32)
        s1 = tl.load(sin_row + d).to(tl.float32)
        s2 = tl.load(sin_row + HALF + d).to(tl.float32)
        o1 = ((n1 * c1).to(dtype).to(tl.float32) + (-(n2 * s1)).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((n2 * c2).to(dtype).to(tl.float32) + (n1 * s2).to(dtype).to(tl.float32)).to(dtype)
        return o1, o2

    @triton.jit
    def _quantize_e4m3(x, scale):
        """float32 x / scale as float8_e4m3fn, as kv_cache.quantize_fp8 rounds: IEEE division, clamp to +-448,
        then round to nearest even at e4m3's spacing in float32 arithmetic, so that the final cast is exact. (The
        hardware cast rounds the same way; Triton 3.6's CPU interpreter truncates mantissa carries and rounds ties
        up, so its cast alone is not a reference.) y + 1.5 * 2^(u + 23) rounds y to a multiple of 2^u, the e4m3
        spacing near y: 2^(exponent - 3) for normals, 2^-9 below 2^-6."""
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        biased = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
        u = tl.maximum(biased - 127, -6) - 3
        magic = (((u + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
        r = (y + magic) - magic
        r = tl.where(r == 0.0, y * 0.0, r)  # keeps the sign of values that round to zero (-0 is 0x80)
        return r.to(tl.float8e4nv)

    @triton.jit
    def _store_kv(ptr, x, mask, scale, FP8: tl.constexpr):
        if FP8:
            tl.store(ptr, _quantize_e4m3(x.to(tl.float32), scale), mask=mask)
        else:
            tl.store(ptr, x, mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr,
        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
        eps, k_scale, v_scale, stride_qkv, stride_cos,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
        FP8_CACHE: tl.constexpr,
    ):
        """Program (token, head block): the first cdiv(NUM_HEADS, BLOCK_H) blocks are query heads, the rest
        KV heads (whose programs also copy V and write K and V into the token's cache slot, quantized with
        k_scale / v_scale into an FP8 cache)."""
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        Q_BLOCKS: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
        HALF: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, HALF)[None, :]
        row_in = qkv_ptr + t * stride_qkv
        cos_row = cos_ptr + t * stride_cos
        sin_row = sin_ptr + t * stride_cos
        if hb < Q_BLOCKS:
            heads = (hb * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
            h_mask = heads < NUM_HEADS
            o1, o2 = _norm_rope_heads(row_in + heads * HEAD_DIM, h_mask, qw_ptr, cos_row, sin_row, eps, HEAD_DIM)
            dst = q_ptr + t * (NUM_HEADS * HEAD_DIM) + heads * HEAD_DIM + d
            tl.store(dst, o1, mask=h_mask)
            tl.store(dst + HALF, o2, mask=h_mask)
        else:
            heads = ((hb - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None]
            h_mask = heads < NUM_KV_HEADS
            k_src = row_in + (NUM_HEADS + heads) * HEAD_DIM
            o1, o2 = _norm_rope_heads(k_src, h_mask, kw_ptr, cos_row, sin_row, eps, HEAD_DIM)
            slot = tl.load(slots_ptr + t).to(tl.int64)
            kv_row = NUM_KV_HEADS * HEAD_DIM
            off_t = t * kv_row + heads * HEAD_DIM + d
            off_slot = slot * kv_row + heads * HEAD_DIM + d
            tl.store(k_ptr + off_t, o1, mask=h_mask)
            tl.store(k_ptr + off_t + HALF, o2, mask=h_mask)
            _store_kv(k_cache_ptr + off_slot, o1, h_mask, k_scale, FP8_CACHE)
            _store_kv(k_cache_ptr + off_slot + HALF, o2, h_mask, k_scale, FP8_CACHE)
            v_src = k_src + NUM_KV_HEADS * HEAD_DIM + d
            v1 = tl.load(v_src, mask=h_mask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=h_mask, other=0.0)
            tl.store(v_ptr + off_t, v1, mask=h_mask)
            tl.store(v_ptr + off_t + HALF, v2, mask=h_mask)
            _store_kv(v_cache_ptr + off_slot, v1, h_mask, v_scale, FP8_CACHE)
            _store_kv(v_cache_ptr + off_slot + HALF, v2, h_mask, v_scale, FP8_CACHE)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          out: torch.Tensor | None = None, res_out: torch.Tensor | None = None):
    """out / res_out: where to write (row-contiguous [T, hidden]; res_out may be residual itself: each program reads
    its row whole before it writes it). None: new tensors."""
    if x.stride(-1) != 1 or x.dim() != 2:
        raise ValueError(f"rms_norm needs [T, hidden] rows with a contiguous last dim, got shape {tuple(x.shape)}")
    for given in (out, res_out):
        if given is not None and (given.shape != x.shape or given.stride(-1) != 1):
            raise ValueError(f"rms_norm output of shape {tuple(given.shape)} for rows of shape {tuple(x.shape)}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if res_out is None:
        res_out = torch.empty_like(out) if residual is not None else out
    r = residual if residual is not None else x
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, r, weight, out, res_out, n, eps, x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 8),
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] -> RMSNorm(x) * weight, in x.dtype (into out if given)."""
    return _norm(x, None, weight, eps, out)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); the sum rounded to x.dtype first, as transformers adds.
    out / res_out: where to write them (res_out may be residual: the sum replaces it in place)."""
    if residual.shape != x.shape or residual.stride(-1) != 1:
        raise ValueError(f"residual of shape {tuple(residual.shape)} for rows of shape {tuple(x.shape)}")
    return _norm(x, residual, weight, eps, out, res_out)


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (heads + 2 kv_heads) * head_dim] (the fused projection) -> q [T, heads, head_dim], k, v [T,
    kv_heads, head_dim]: per-head RMSNorm then RoPE (cos/sin [T, head_dim]) on q and k; k and v also written
    to slot_mapping's rows of the caches ([num_blocks, block_size, kv_heads, head_dim], contiguous; in qkv's
    dtype, or float8_e4m3fn holding quantize_fp8(k, k_scale) and quantize_fp8(v, v_scale)). out: contiguous
    (q, k, v) to write into instead of new tensors."""
    t = qkv.shape[0]
    head_dim = cos.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv of shape {tuple(qkv.shape)} is not [T, ({num_heads} + 2 x {num_kv_heads}) x {head_dim}]")
    if head_dim & (head_dim - 1) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("qk_norm_rope_write_kv needs a power-of-two head_dim and contiguous K/V caches")
    if k_cache.shape[-2:] != (num_kv_heads, head_dim) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"K cache rows {tuple(k_cache.shape[-2:])} / cos-sin layout do not fit ({num_kv_heads}, {head_dim})")
    if out is None:
        q = qkv.new_empty(t, num_heads, head_dim)
        k = qkv.new_empty(t, num_kv_heads, head_dim)
        v = qkv.new_empty(t, num_kv_heads, head_dim)
    else:
        q, k, v = out
        if (q.shape, k.shape, v.shape) != ((t, num_heads, head_dim), (t, num_kv_heads, head_dim), (t, num_kv_heads, head_dim)) \
                or not all(o.is_contiguous() for o in out):
            raise ValueError(f"qk_norm_rope_write_kv outputs {[tuple(o.shape) for o in out]} are not contiguous "
                             f"[{t}, {num_heads}/{num_kv_heads}, {head_dim}]")
    if t:
        blocks = triton.cdiv(num_heads, HEADS_PER_PROGRAM) + triton.cdiv(num_kv_heads, HEADS_PER_PROGRAM)
        _qk_norm_rope_kernel[(t, blocks)](
            qkv, q_weight, k_weight, cos, sin, slot_mapping, q, k, v, k_cache, v_cache,
            eps, k_scale, v_scale, qkv.stride(0), cos.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=HEADS_PER_PROGRAM,
            FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn, num_warps=4,
        )
    return q, k, v
