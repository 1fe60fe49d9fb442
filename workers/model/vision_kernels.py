"""The vision tower's elementwise chains as one kernel each: residual add + LayerNorm, and the 2-D rotary on q and k.
Triton on CUDA; everywhere else (CPU, other devices, no Triton) a torch reference of the same math.

Both round where transformers rounds: the residual sum to the activation dtype before the norm reads it, the norm
and the rotary in float32 with one rounding of each output (nn.LayerNorm, apply_rotary_pos_emb_vision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ROTARY_TOKENS_PER_PROGRAM = 16


def supports(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for x: Triton present and x on a CUDA device."""
    return triton is not None and x.is_cuda


# ---- torch references --------------------------------------------------------------------------------------------


def add_layer_norm_reference(
    residual: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(residual + update), residual + update); update None: (LayerNorm(residual), residual)."""
    if update is not None:
        residual = residual + update
    return F.layer_norm(residual, weight.shape, weight, bias, eps), residual


def rotary_qk_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, 3 * heads * head_dim] -> q, k [N, heads, head_dim] rotated (x * cos + rotate_half(x) * sin, float32,
    one rounding), v [N, heads, head_dim] (a view of qkv). cos/sin [N, head_dim / 2] float32: HF's tables repeat
    their first half, so half of each is all the rotation needs."""
    q, k, v = qkv.view(qkv.shape[0], 3, num_heads, -1).unbind(1)
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rotate(q), rotate(k), v


# ---- Triton kernels -----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _add_layer_norm_kernel(res_ptr, upd_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, n, eps,
                               HAS_UPDATE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(res_ptr + row * n + offs, mask=mask, other=0.0)
        if HAS_UPDATE:  # the residual add rounds to the activation dtype before the norm reads it
            u = tl.load(upd_ptr + row * n + offs, mask=mask, other=0.0)
            s = (s.to(tl.float32) + u.to(tl.float32)).to(s.dtype)
            tl.store(res_out_ptr + row * n + offs, s, mask=mask)
        x = s.to(tl.float32)
        mean = tl.sum(x, axis=0) / n
        d = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + offs, (d * rstd * w + b).to(s.dtype), mask=mask)

    @triton.jit
    def _rotate_head(src, dst, c, s, mask, HALF: tl.constexpr):
        """One head of a [tokens, HALF_P2] tile pair: (x1 c - x2 s, x2 c + x1 s) in float32, rounded once."""
        x1 = tl.load(src, mask=mask, other=0.0)
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(dst, (f1 * c - f2 * s).to(x1.dtype), mask=mask)
        tl.store(dst + HALF, (f2 * c + f1 * s).to(x1.dtype), mask=mask)

    @triton.jit(do_not_specialize=["n_tokens"])  # the patches of a tower call: one compile for all
    def _rotary_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, n_tokens, stride_qkv,
                          NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                          BLOCK_T: tl.constexpr):
        """Program: BLOCK_T tokens, all heads of q and k (cos/sin loaded once for them)."""
        HEAD_DIM: tl.constexpr = 2 * HALF
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        d = tl.arange(0, HALF_P2)
        mask = (t < n_tokens)[:, None] & (d < HALF)[None, :]
        c = tl.load(cos_ptr + t[:, None] * HALF + d[None, :], mask=mask, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * HALF + d[None, :], mask=mask, other=0.0)
        src = qkv_ptr + t[:, None] * stride_qkv + d[None, :]
        dst = t[:, None] * (NUM_HEADS * HEAD_DIM) + d[None, :]
        for h in range(NUM_HEADS):
            _rotate_head(src + h * HEAD_DIM, q_ptr + dst + h * HEAD_DIM, c, s, mask, HALF)
            _rotate_head(src + (NUM_HEADS + h) * HEAD_DIM, k_ptr + dst + h * HEAD_DIM, c, s, mask, HALF)


def add_layer_norm(
    residual: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [T, n]: (LayerNorm(residual + update) * weight + bias, residual + update), the sum rounded to the
    activation dtype first as transformers adds; update None (nothing pending): (LayerNorm(residual), residual)."""
    kernel = add_layer_norm_triton if supports(residual) else add_layer_norm_reference
    return kernel(residual, update, weight, bias, eps)


def add_layer_norm_triton(
    residual: torch.Tensor, update: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_layer_norm's Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if residual.dim() != 2 or not residual.is_contiguous() or residual.shape[1] != weight.shape[0]:
        raise ValueError(f"add_layer_norm needs contiguous rows of {weight.shape[0]}, got {tuple(residual.shape)}")
    if update is not None and (update.shape != residual.shape or not update.is_contiguous()):
        raise ValueError(f"update of shape {tuple(update.shape)} for rows of shape {tuple(residual.shape)}")
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual) if update is not None else residual
    rows, n = residual.shape
    block = triton.next_power_of_2(n)
    if rows:
        _add_layer_norm_kernel[(rows,)](
            residual, update if update is not None else residual, weight, bias, out, res_out, n, eps,
            HAS_UPDATE=update is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
        )
    return out, res_out


def rotary_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, 3 * heads * head_dim] (the fused projection) -> q, k [N, heads, head_dim] rotated, contiguous (the
    [batch, len, heads, dim] memory SDPA's kernels read through a transpose without a copy), and v, a strided view
    of qkv. cos/sin [N, head_dim / 2] float32 (see rotary_qk_reference)."""
    kernel = rotary_qk_triton if supports(qkv) else rotary_qk_reference
    return kernel(qkv, cos, sin, num_heads)


def rotary_qk_triton(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rotary_qk's Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    n, half = cos.shape
    if qkv.shape != (n, 6 * num_heads * half) or qkv.stride(1) != 1 or sin.shape != cos.shape:
        raise ValueError(f"qkv {tuple(qkv.shape)} / cos {tuple(cos.shape)} do not fit {num_heads} heads of {2 * half}")
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32):
        raise ValueError("rotary_qk needs contiguous float32 cos/sin tables")
    qk = qkv.new_empty(2, n, num_heads, 2 * half)
    if n:
        _rotary_qk_kernel[(triton.cdiv(n, ROTARY_TOKENS_PER_PROGRAM),)](
            qkv, cos, sin, qk[0], qk[1], n, qkv.stride(0),
            NUM_HEADS=num_heads, HALF=half, HALF_P2=triton.next_power_of_2(half), BLOCK_T=ROTARY_TOKENS_PER_PROGRAM,
            num_warps=4,
        )
    return qk[0], qk[1], qkv.view(n, 3, num_heads, -1)[:, 2]
