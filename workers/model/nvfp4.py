"""NVFP4 weights (NVIDIA ModelOpt's unified checkpoint, quant_algo "NVFP4": the format of NVIDIA's MLPerf Qwen3-VL
checkpoints) and their conversion to the e4m3 weights this engine computes with on Hopper, which has no FP4 tensor
cores.

Facts used, with their public sources (vLLM `vllm/model_executor/layers/quantization/modelopt.py`,
`ModelOptNvFp4Config` and `ModelOptNvFp4LinearMethod`; its test helpers `tests/kernels/quantization/nvfp4_utils.py`,
`break_fp4_bytes` and `dequantize_nvfp4_to_dtype`: https://github.com/vllm-project/vllm; NVIDIA
TensorRT-Model-Optimizer's unified HF export, https://github.com/NVIDIA/TensorRT-Model-Optimizer):
* `<module>.weight` is uint8 [N, K/2]: two e2m1 codes a byte, the even column in the low nibble. A code is a sign bit
  (0x8) and an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6.
* `<module>.weight_scale` is float8_e4m3fn [N, K/16]: one scale per 16 consecutive columns (group_size), stored
  row-major on disk (vLLM swizzles it at load for its kernels).
* `<module>.weight_scale_2` is a float32 scalar per tensor: amax / (6 * 448). The weight is
  code value x weight_scale x weight_scale_2 (vLLM's emulation divides by global_scale = 1 / weight_scale_2).
* `<module>.input_scale` is a float32 scalar: the static activation scale of FP4 activations, which this engine does
  not use (it quantises activations to e4m3 per token on the fly, as the FP8-dynamic format does).
"""

from __future__ import annotations

import torch

from workers.model.fp8 import FP8_DTYPE, FP8_MAX

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
GROUP = 16  # columns per weight_scale entry (the format's group_size)


def _value_table(device: torch.device) -> torch.Tensor:
    """The 16 codes' values: indices 0-7 positive, 8-15 the same negated."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([values, -values])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float32 [..., K]: each byte's low nibble is the even column, its high nibble the odd."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed e2m1 codes must be uint8, got {packed.dtype}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    return _value_table(packed.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes (0-15, any integer dtype) [..., K], K even -> uint8 [..., K/2] (unpack_e2m1's inverse)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"e2m1 codes pack in pairs: last dimension {codes.shape[-1]} is odd")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | float,
                     group: int = GROUP) -> torch.Tensor:
    """An NVFP4 weight [..., N, K] in float32: code value x weight_scale (per group of columns) x weight_scale_2."""
    values = unpack_e2m1(packed)
    k = values.shape[-1]
    if scale.shape[-1] * group != k or scale.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a weight of {tuple(values.shape)} "
                         f"in groups of {group} columns")
    groups = scale.float().repeat_interleave(group, dim=-1)
    return values * groups * torch.as_tensor(global_scale, dtype=torch.float32, device=values.device)


def quantize_nvfp4(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [..., N, K] as NVFP4 (packed codes, e4m3 group scales, float32 scalar weight_scale_2), by
    ModelOpt's recipe: weight_scale_2 = amax / (6 * 448); a group's scale is its amax / 6 / weight_scale_2 in e4m3;
    each value rounds to the nearest e2m1 value of weight / (group scale x weight_scale_2). For tests and tiny
    checkpoints; a real checkpoint comes from NVIDIA's calibration."""
    w = weight.float()
    if w.shape[-1] % group:
        raise ValueError(f"K = {w.shape[-1]} is not a multiple of the group size {group}")
    global_scale = (w.abs().amax() / (E2M1_MAX * FP8_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    grouped = w.unflatten(-1, (-1, group))
    scale = (grouped.abs().amax(dim=-1) / E2M1_MAX / global_scale).clamp(max=FP8_MAX).to(FP8_DTYPE)
    divisor = scale.float().clamp(min=torch.finfo(torch.float32).tiny) * global_scale
    x = grouped / divisor.unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES, device=w.device)
    index = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (index + 8 * (x < 0)).flatten(-2)
    return pack_e2m1(codes), scale, global_scale.reshape(())
