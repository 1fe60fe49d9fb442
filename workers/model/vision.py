"""The Qwen3-VL vision tower: transformers' own vision module, loaded with the checkpoint's model.visual.* weights,
with its per-image attention loop replaced by one SDPA call per run of equal-size images and its patch-embedding
Conv3d run as the equivalent GEMM.

encode() turns pixel patches of several images into main embeddings plus the DeepStack features.
"""

from __future__ import annotations

import importlib
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from workers.weights import VISION_PREFIX, CheckpointError, ModelConfig, init_random_weights, iter_tensors


class BatchedVisionAttention(nn.Module):
    """Bidirectional attention within each image, on the tower's own qkv/proj weights. Images of one size
    that follow each other share one batched SDPA call; the runs come from the host (no device sync)."""

    def __init__(self, attn: nn.Module, rotary):
        super().__init__()
        self.qkv, self.proj = attn.qkv, attn.proj
        self.num_heads, self.scaling = attn.num_heads, attn.scaling
        self.rotary = rotary
        self.runs: list[tuple[int, int]] = []  # (frame length, number of frames) in order, set per encode

    def forward(self, hidden_states: torch.Tensor, cu_seqlens=None, position_embeddings=None, **kwargs) -> torch.Tensor:
        if position_embeddings is None:
            raise RuntimeError("this transformers version does not pass position_embeddings to vision attention")
        seq = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = self.rotary(q, k, *position_embeddings)
        out = torch.empty_like(q)
        start = 0
        for length, count in self.runs:
            end = start + length * count
            qs, ks, vs = (t[start:end].view(count, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=self.scaling)
            out[start:end] = o.transpose(1, 2).reshape(end - start, self.num_heads, -1)
            start = end
        if start != seq:
            raise RuntimeError(f"vision attention planned for {start} patches, got {seq}")
        return self.proj(out.reshape(seq, -1))


class PatchLinear(nn.Module):
    """The patch embedding's Conv3d as the GEMM it is: its kernel covers each whole [C, T, P, P] patch with the
    same stride, so every output is one dot product of a flattened patch with a flattened filter. cuDNN has no
    good algorithm for that degenerate convolution in bf16; a linear layer runs it as one cuBLAS GEMM."""

    def __init__(self, conv: nn.Conv3d):
        super().__init__()
        if tuple(conv.stride) != tuple(conv.kernel_size) or any(conv.padding) or conv.groups != 1 or any(d != 1 for d in conv.dilation):
            raise ValueError(f"patch embedding {conv} is not a non-overlapping patch projection")
        self.weight, self.bias = conv.weight, conv.bias  # [out, C, T, P, P]: the checkpoint's own tensors

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C, T, P, P] -> [N, out, 1, 1, 1], as the convolution returns them."""
        out = F.linear(patches.reshape(patches.shape[0], -1), self.weight.view(self.weight.shape[0], -1), self.bias)
        return out.view(*out.shape, 1, 1, 1)


def frame_runs(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """(patches per frame, consecutive frames of that size) for grid_thw [n, 3] (t frames of h*w each)."""
    lengths = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
    return [(length, len(list(group))) for length, group in itertools.groupby(lengths)]


class VisionEncoder:
    """checkpoint None: random weights (load_format 'random'), built directly on the device."""

    def __init__(
        self, model_config: ModelConfig, checkpoint: Path | None, device: torch.device, dtype: torch.dtype, seed: int = 0
    ):
        from transformers.initialization import no_init_weights

        if model_config.arch == "moe":
            from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel as cls
        else:
            from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
        with no_init_weights(), torch.device(device):
            model = cls._from_config(model_config.hf_config.vision_config, attn_implementation="sdpa", dtype=dtype)
        if checkpoint is None:
            init_random_weights(model, seed)
        else:
            state = dict(iter_tensors(checkpoint, VISION_PREFIX))
            result = model.load_state_dict(state, strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise CheckpointError(
                    f"{checkpoint}: vision weights do not match the vision config "
                    f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})"
                )
        self.model = model.to(device=device, dtype=dtype).eval()
        model.patch_embed.proj = PatchLinear(model.patch_embed.proj)
        rotary = importlib.import_module(type(model).__module__).apply_rotary_pos_emb_vision
        self.attentions = [BatchedVisionAttention(block.attn, rotary) for block in model.blocks]
        for block, attn in zip(model.blocks, self.attentions):
            block.attn = attn
        self.device = device
        self.dtype = dtype
        self.spatial_merge_unit = model_config.spatial_merge_size**2

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [patches, C*T*P*P], grid_thw [n, 3] -> (embeds [tokens, H], DeepStack [[tokens, H], ...])."""
        runs = frame_runs(grid_thw)
        for attn in self.attentions:
            attn.runs = runs
        out = self.model(
            pixel_values.to(device=self.device, dtype=self.dtype), grid_thw=grid_thw.to(self.device), return_dict=True
        )
        return out.pooler_output, list(out.deepstack_features)
