"""FP8 (e4m3) block quantization as the released Qwen3-VL FP8 checkpoints use it: weights in blocks with one
dequantisation scale each, activations quantised on the fly per token and group of K columns.

The torch functions here are the references the Triton kernels (workers/model/fp8_gemm.py, fused_moe.py) are
checked against, and the CPU path. Facts this module relies on, with their public sources:

* Layout (DeepSeek-V3 "fine-grained FP8", adopted by Qwen for `Qwen/Qwen3-VL-*-Instruct-FP8`; transformers
  `integrations/finegrained_fp8.py` `FP8Linear`, vLLM `model_executor/layers/quantization/fp8.py`): a quantised
  linear's `weight` is float8_e4m3fn [N, K] and `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] with
  `quantization_config.weight_block_size` [bn, bk] (128 x 128 in the releases). Despite its name
  `weight_scale_inv` is the multiplier that dequantises: w = w_fp8 * weight_scale_inv over each block
  (transformers `Fp8Dequantize._dequantize_one`, DeepSeek-V3 `inference/kernel.py` `weight_dequant`).
* Quantisation of a block (transformers `Fp8Quantize._quantize_one`): scale_inv = amax(|w|) / 448, w_fp8 =
  clamp(w / scale_inv, -448, 448) rounded to e4m3; an all-zero block keeps scale_inv 1.
* Activations (`activation_scheme: dynamic`; vLLM `per_token_group_quant_fp8`, transformers `act_quant`): per token
  and group of `bk` columns, scale = max(amax(|x|), eps) / 448, x_fp8 = clamp(x / scale) in e4m3; the GEMM
  accumulates sum_k x_fp8 * w_fp8 in float32 per K block and multiplies by x_scale[m, kb] * w_scale[nb, kb].
"""

from __future__ import annotations

import torch

from workers.checkpoint_quant import BlockShape

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Against block-scaled weights, activations are quantised in groups of at most this many columns: one scale per
# 128-wide GEMM K tile. Against per-channel weights (one scale spans a whole row) one scale per token: see
# activation_group.
ACTIVATION_GROUP = 128
# vLLM's per_token_group_quant_fp8 floors a group's amax at 1e-10, so an all-zero group gets a finite scale.
ACTIVATION_AMAX_FLOOR = 1e-10


def _expand(scale: torch.Tensor, block: BlockShape, rows: int, cols: int) -> torch.Tensor:
    """[..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols]: each block's scale over its elements."""
    scale = scale.repeat_interleave(min(block.n, rows), dim=-2)[..., :rows, :]
    return scale.repeat_interleave(min(block.k, cols), dim=-1)[..., :cols]


def quantize_weight_blocks(weight: torch.Tensor, block: BlockShape) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (any float dtype) -> (float8_e4m3fn [..., N, K], weight_scale_inv float32 [..., nb, kb])."""
    rows, cols = weight.shape[-2:]
    nb, kb = block.grid(rows, cols)
    bn, bk = min(block.n, rows), min(block.k, cols)  # a block larger than the weight covers all of it
    w = weight.float()
    padded = w.new_zeros(*w.shape[:-2], nb * bn, kb * bk)
    padded[..., :rows, :cols] = w
    tiles = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (w / _expand(scale_inv, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def dequantize_weight_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: BlockShape, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float8 [..., N, K] and its scales [..., nb, kb] -> [..., N, K] in dtype (computed in float32, rounded once)."""
    rows, cols = weight.shape[-2:]
    expected = block.grid(rows, cols)
    if tuple(scale_inv.shape[-2:]) != expected or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} in blocks of "
            f"{block.n}x{block.k} (expected {(*weight.shape[:-2], *expected)})"
        )
    return (weight.float() * _expand(scale_inv.float(), block, rows, cols)).to(dtype)


def activation_group(block: BlockShape, k: int) -> int:
    """Columns per activation scale for a GEMM over K = k against weights scaled in `block`s. A weight scale as wide
    as the row (per-channel checkpoints: compressed-tensors' FP8_DYNAMIC scheme, `input_activations` strategy
    "token"; vLLM `CompressedTensorsW8A8Fp8` with dynamic per-token scales) pairs with one scale per token, k; block
    scales with groups of min(block.k, 128) (the block format's per-token-group scales). Either way a K of at most
    the group is one group."""
    return k if block.k >= k else min(block.k, ACTIVATION_GROUP)


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], scales float32 [M, ceil(K/group)]): per token, per group of columns."""
    m, k = x.shape
    groups = -(-k // group)
    padded = x.float().new_zeros(m, groups * group)
    padded[:, :k] = x.float()
    amax = padded.view(m, groups, group).abs().amax(dim=-1).clamp(min=ACTIVATION_AMAX_FLOOR)
    # A tensor divisor: CUDA torch divides by a Python scalar through its reciprocal (an ulp off IEEE division),
    # which the kernels and the CPU do not.
    scales = amax / torch.full_like(amax, FP8_MAX)
    q = (x.float() / scales.repeat_interleave(group, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def fake_quantize_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded as the W8A8 kernels see it: per token and group of columns to e4m3 and back, in float32."""
    q, scales = quantize_activation_groups(x, group)
    return q.float() * scales.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def block_fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: BlockShape, bias: torch.Tensor | None = None,
    *, act_group: int | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype, as the W8A8 kernels compute it: x quantised per token and group of act_group
    (default activation_group(block, K)) columns, float32 accumulation, both scales applied per block."""
    a = fake_quantize_activations(x, act_group or activation_group(block, x.shape[-1]))
    out = a @ dequantize_weight_blocks(weight, scale_inv, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
