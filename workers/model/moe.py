"""Qwen3-VL MoE feed-forward: fp32 softmax router, top-k renormalised, SwiGLU experts in fused weights.

Experts are held as transformers holds them in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoeRouter(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_i


class MoeExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Token-expert pairs sorted by expert; one GEMM pair per expert that was hit."""
        k = top_i.shape[1]
        flat_expert = top_i.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of_pair = order // k
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            tokens = token_of_pair[start : start + count]
            start += count
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            y = y * top_w.reshape(-1)[pairs, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate = MoeRouter(num_experts, hidden_size, top_k)
        self.experts = MoeExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_w, top_i = self.gate(x)
        return self.experts(x, top_w, top_i)
