"""Small building blocks of the Qwen3-VL text tower: RMSNorm (+ residual add), interleaved MRoPE, SwiGLU MLP.

Each computes in the same dtype order as transformers so greedy tokens match it exactly; on CUDA the norms run
as one Triton kernel each (workers/model/fused_norm_rope.py), on the CPU as the torch code here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import fused_norm_rope


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_norm_rope.supports(x):
            return fused_norm_rope.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return rms_norm_reference(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (norm(x + residual), x + residual); the sum is rounded to the activation
        dtype before the norm reads it, as transformers' residual add does."""
        if fused_norm_rope.supports(x):
            return fused_norm_rope.add_rms_norm(x, residual, self.weight, self.eps)
        total = residual + x
        return self(total), total


class MRotaryEmbedding:
    """Interleaved multimodal RoPE: frequency j takes its angle from the H axis when j % 3 == 1, from W
    when j % 3 == 2 (within mrope_section), else from T. Equals plain RoPE when t == h == w."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int], device: torch.device):
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"rope_parameters.mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        axis[1 : mrope_section[1] * 3 : 3] = 1
        axis[2 : mrope_section[2] * 3 : 3] = 2
        self.axis = axis.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> cos, sin [T, head_dim] in dtype."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, hd/2]
        freqs = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


@torch.no_grad()
def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the given ones' outputs side by side (their weights and biases stacked)."""
    weight = torch.cat([lin.weight for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


class DenseMLP(nn.Module):
    """gate_proj / up_proj are what the checkpoint loads into; fuse_projections() then makes them one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
