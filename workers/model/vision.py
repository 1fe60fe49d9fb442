"""The Qwen3-VL vision tower: transformers' own vision module, loaded with the checkpoint's model.visual.* weights.

encode() turns pixel patches of several images into main embeddings plus the DeepStack features.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.weights import VISION_PREFIX, CheckpointError, ModelConfig, init_random_weights, iter_tensors


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
        self.device = device
        self.dtype = dtype
        self.spatial_merge_unit = model_config.spatial_merge_size**2

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [patches, C*T*P*P], grid_thw [n, 3] -> (embeds [tokens, H], DeepStack [[tokens, H], ...])."""
        out = self.model(
            pixel_values.to(device=self.device, dtype=self.dtype), grid_thw=grid_thw.to(self.device), return_dict=True
        )
        return out.pooler_output, list(out.deepstack_features)
