"""The vision tower against transformers' module: the module with random weights at unit gain, random pixels for a
list of grids, the module's outputs, and the relative error between two outputs."""

from __future__ import annotations

import torch
from torch import nn

from workers.model.vision import build_vision_module

# Several sizes in one batch: a run of two equal images, odd aspect ratios, and a video-like grid of two frames.
GRIDS = [[1, 4, 4], [1, 4, 4], [1, 2, 6], [2, 4, 4], [1, 6, 2], [1, 8, 8]]


def randomized_module(vision_config, device: str, dtype: torch.dtype, arch: str = "moe") -> nn.Module:
    """The module with every parameter random at unit gain (matrices ~N(0, 1/fan_in)), so attention is sharp and
    no norm weight or bias is a no-op."""
    module = build_vision_module(arch, vision_config, torch.device(device), dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            draw = torch.randn(param.shape, generator=gen, device=device)
            if name.rsplit(".", 2)[-2].startswith("norm") and name.endswith("weight"):
                param.copy_(1 + 0.1 * draw)
            elif param.dim() == 1:
                param.copy_(0.1 * draw)
            else:
                param.copy_(draw / param[0].numel() ** 0.5)
    return module.eval()


def pixels_for(grids: list[list[int]], width: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, width, generator=torch.Generator(device=device).manual_seed(1), device=device, dtype=dtype)


def transformers_output(module: nn.Module, pixels: torch.Tensor, grid: torch.Tensor):
    out = module(pixels, grid_thw=grid.to(pixels.device), return_dict=True)
    return out.pooler_output, list(out.deepstack_features)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()
