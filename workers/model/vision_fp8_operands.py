"""The FP8 vision attention kernels' operands, quantised per head and laid out for tensor descriptors, in one Triton
launch each on CUDA, in torch elsewhere (Triton's interpreter rounds some values to e4m3 wrongly: 126.1 to 64, 168
to 176, where the GPU's cvt.rn.satfinite gives 128 and 160; its tests take values e4m3 holds exactly).

- rows: x [N, heads, dim] -> e4m3 [N, heads, padded_dim], zero past dim (q and k: the scores' tail k-step);
- transposed: v [N, heads, dim] -> e4m3 [heads, value_rows, key_width], each key at its column (the plan's aligned key
  layout: each frame from a multiple of 16 keys, zeros between), rows past dim as the caller filled them.

In torch the same takes five to seven kernels an operand and float32 copies of it (the bf16 input read three times,
a float32 copy written and read twice): at 62,500 patches that is most of a millisecond an operand, 27 times a pass.
"""

from __future__ import annotations

import torch

from workers.model.fp8 import FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_ROWS = 32  # rows a program
BLOCK_KEYS = 64  # keys a program of the transposed layout (64 bytes along a row of the output)
BLOCK_COLS = 128  # head_dim and its padding, as a power of two


def _triton_runs(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def head_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 [heads]: each head's amax over x [N, heads, dim] / 448 (at least 1e-12 / 448)."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=(0, 2)).float()
    return amax.clamp(min=1e-12) / FP8_MAX


def quantize_rows(x: torch.Tensor, scale: torch.Tensor, padded_dim: int) -> torch.Tensor:
    """x [N, heads, dim] (unit stride along dim) / scale[head] -> e4m3 [N, heads, padded_dim], zero past dim."""
    seq, heads, dim = x.shape
    if not dim <= padded_dim <= BLOCK_COLS:
        raise ValueError(f"quantize_rows: padded_dim {padded_dim} must be between head_dim {dim} and {BLOCK_COLS}")
    if not _triton_runs(x) or not seq:
        out = torch.zeros(seq, heads, padded_dim, dtype=torch.float8_e4m3fn, device=x.device)
        out[:, :, :dim] = (x.float() / scale[None, :, None]).to(torch.float8_e4m3fn)
        return out
    out = torch.empty(seq, heads, padded_dim, dtype=torch.float8_e4m3fn, device=x.device)
    _quantize_rows_kernel[(triton.cdiv(seq, BLOCK_ROWS), heads)](
        x, scale, out, seq, x.stride(0), x.stride(1), out.stride(0), out.stride(1), DIM=dim, PADDED=padded_dim,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    return out


def quantize_transposed(v: torch.Tensor, scale: torch.Tensor, columns: torch.Tensor, out: torch.Tensor) -> None:
    """v [N, heads, dim] (unit stride along dim) / scale[head] -> out [heads, rows >= dim, key_width] (e4m3): out[h,
    d, columns[n]] = v[n, h, d]; out's other entries are left as they are."""
    seq, heads, dim = v.shape
    if out.shape[0] != heads or out.shape[1] < dim or not out.is_contiguous():
        raise ValueError(f"quantize_transposed: out must be contiguous [{heads}, >= {dim}, keys], got "
                         f"{tuple(out.shape)}")
    if not _triton_runs(v) or not seq:
        v8 = (v.float() / scale[None, :, None]).to(torch.float8_e4m3fn)
        out[:, :dim].view(torch.uint8).index_copy_(2, columns, v8.permute(1, 2, 0).view(torch.uint8))
        return
    _quantize_transposed_kernel[(triton.cdiv(seq, BLOCK_KEYS), heads)](
        v, scale, columns, out, seq, v.stride(0), v.stride(1), out.stride(0), out.stride(1), DIM=dim,
        BLOCK_KEYS=BLOCK_KEYS, BLOCK_COLS=BLOCK_COLS)


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, scale_ptr, out_ptr, seq, stride_xn, stride_xh, stride_on, stride_oh,
                              DIM: tl.constexpr, PADDED: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                              BLOCK_COLS: tl.constexpr):
        head = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        inside = rows[:, None] < seq
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xn + head * stride_xh + cols[None, :],
                    mask=inside & (cols[None, :] < DIM), other=0.0)
        q = (x.to(tl.float32) / tl.load(scale_ptr + head)).to(tl.float8e4nv)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + head * stride_oh + cols[None, :], q,
                 mask=inside & (cols[None, :] < PADDED))

    @triton.jit
    def _quantize_transposed_kernel(v_ptr, scale_ptr, columns_ptr, out_ptr, seq, stride_vn, stride_vh, stride_oh,
                                    stride_od, DIM: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                                    BLOCK_COLS: tl.constexpr):
        head = tl.program_id(1)
        keys = tl.program_id(0) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
        dims = tl.arange(0, BLOCK_COLS)
        inside = keys < seq
        mask = inside[:, None] & (dims[None, :] < DIM)
        v = tl.load(v_ptr + keys[:, None].to(tl.int64) * stride_vn + head * stride_vh + dims[None, :], mask=mask,
                    other=0.0)
        q = tl.trans((v.to(tl.float32) / tl.load(scale_ptr + head)).to(tl.float8e4nv))  # keys along the rows
        columns = tl.load(columns_ptr + keys, mask=inside, other=0)
        tl.store(out_ptr + head * stride_oh + dims[:, None].to(tl.int64) * stride_od + columns[None, :], q,
                 mask=(dims[:, None] < DIM) & inside[None, :])
