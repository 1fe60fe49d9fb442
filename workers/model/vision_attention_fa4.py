"""The vision tower's attention through FlashAttention-4 (`flash-attn-4` on PyPI, Tri Dao's CuTe DSL kernels,
https://github.com/Dao-AILab/flash-attention, flash_attn/cute). Its Hopper forward is FlashAttention-3's schedule:
a producer warp feeding K and V tiles by TMA, two consumer warpgroups whose MMAs run beneath each other's softmax,
here 192 x 144 tiles with head_dim 72 padded to 80 in shared memory, not in global memory. One launch covers a tower
call's frames (varlen, through cumulative frame lengths). vision_attention runs it for a call whose largest frame
has FA4_FROM_PATCHES or more, SDPA (cuDNN) below, where cuDNN was the faster.

Optional: the package (with `nvidia-cutlass-dsl[cu13]`, ~240 MB unpacked) is imported only when
EngineConfig.vision_attention names "flash_attn4"; CPU installs and CI do not have it, and the GPU image does not
either. An engine that names it without the package stops at its warm-up, naming the key and the package.

Measured on an H100 (benchmarks/README.md, thirty-ninth pass; flash-attn-4 4.0.0b40, 16 heads, head_dim 72, one
frame, the tower's strided V): 425 useful TFLOP/s at 16,384 patches and 453 at 62,500, against the Gluon kernel's
394-396 and 432-439 in earlier runs on H100s.
"""

from __future__ import annotations

import importlib.util

import torch

PACKAGE = "flash-attn-4"
MODULE = "flash_attn.cute"


def installed() -> bool:
    """Whether flash-attn-4's CuTe module can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(MODULE) is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


MISSING = (f"engine.vision_attention 'flash_attn4' needs the {PACKAGE} package (pip install '{PACKAGE}' "
           "'nvidia-cutlass-dsl[cu13]'), which is not installed here")


def require() -> None:
    """Raise, naming the key and the package, where flash-attn-4 is missing."""
    if not installed():
        raise RuntimeError(MISSING)


def attention_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_lengths: torch.Tensor, largest_frame: int,
                  scale: float) -> torch.Tensor:
    """q, k, v [N, heads, dim] (unit stride along dim, 16-byte aligned rows: the tower's q, k and its fused qkv's v
    view) -> [N, heads * dim]: softmax(q k^T * scale) v within each frame, one launch; cu_lengths int32
    [frames + 1], each frame's first row, then N (AttentionPlan.cu_lengths); largest_frame, its largest frame's
    patches."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as exc:
        raise RuntimeError(MISSING) from exc

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_lengths, cu_seqlens_k=cu_lengths,
                                 max_seqlen_q=largest_frame, max_seqlen_k=largest_frame, softmax_scale=scale)
    out = out[0] if isinstance(out, tuple) else out  # (out, lse)
    return out.reshape(q.shape[0], -1)
