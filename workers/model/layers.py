"""Small building blocks of the Qwen3-VL text tower: RMSNorm (+ residual add), interleaved MRoPE, SwiGLU MLP.

Each computes in the same dtype order as transformers so greedy tokens match it exactly; on CUDA the norms run
as one Triton kernel each (workers/model/fused_norm_rope.py), before a layer that reads FP8 activations together
with their quantisation (workers/model/norm_quant.py), on the CPU as the torch code here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import fused_norm_rope, norm_quant
from workers.model.fused_norm_rope import rms_norm_reference
from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import FP8_DTYPE, block_fp8_linear_reference
from workers.model.norm_quant import Fp8Input, Fp8Rows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) * weight; out: [T, hidden] rows to write it into."""
        if fused_norm_rope.supports(x):
            flat = x.reshape(-1, x.shape[-1])
            return fused_norm_rope.rms_norm(flat, self.weight, self.eps, out).view(x.shape)
        normed = rms_norm_reference(x, self.weight, self.eps)
        return normed if out is None else out.copy_(normed)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, hidden] -> (norm(x + residual), x + residual); the sum is rounded to the activation
        dtype before the norm reads it, as transformers' residual add does. out / res_out: rows to write them into
        (res_out may be residual itself: the sum replaces it)."""
        if fused_norm_rope.supports(x):
            return fused_norm_rope.add_rms_norm(x, residual, self.weight, self.eps, out, res_out)
        total = residual + x
        if res_out is not None:
            total = res_out.copy_(total)
        return self(total, out), total

    def norm_for(
        self, x: torch.Tensor, residual: torch.Tensor | None, reader: nn.Module,
        out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(norm(x + residual) as `reader` takes it, x + residual); residual None: x is the whole hidden state (and
        the second value). Where reader.fp8_input(x) names FP8 activations and norm_quant's kernel runs, one launch
        writes the sum, the e4m3 rows and their scales (and the normed rows into out, where the reader reads those
        too): Fp8Rows. Else the normed rows, as forward / add_and_norm."""
        want = reader.fp8_input(x)
        if want is not None and norm_quant.supports(x, want.group):
            return norm_quant.add_norm_quantize(x, residual, self.weight, self.eps, want, out, res_out)
        if residual is None:
            return self(x, out), x
        return self.add_and_norm(x, residual, out, res_out)


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


class Fp8Linear(nn.Module):
    """A linear layer on FP8 weights: weight float8_e4m3fn [N, K], weight_scale float32 [ceil(N/block.n),
    ceil(K/block.k)] (workers/model/fp8.py). On CUDA the W8A8 Triton GEMM (workers/model/fp8_gemm.py) quantises the
    activations per token and group of block.k columns on the fly; elsewhere its torch reference computes the same."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: BlockShape):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        nb, kb = block.grid(out_features, in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(nb, kb, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x [..., K], or [T, K] already quantised as fp8_input asks (the norm before wrote it: Fp8Rows)."""
        from workers.model import fp8_gemm

        if isinstance(x, Fp8Rows):
            if x.group != fp8_gemm.input_group(self.block, self.in_features):
                raise ValueError(f"{self}: activations quantised in groups of {x.group} columns, not "
                                 f"{fp8_gemm.input_group(self.block, self.in_features)}")
            return fp8_gemm.fp8_linear_quantized(x.q, x.scales, self.weight, self.weight_scale, self.block, x.dtype,
                                                 self.bias)
        flat = x.reshape(-1, x.shape[-1])
        if x.is_cuda:
            out = fp8_gemm.fp8_linear(flat, self.weight, self.weight_scale, self.block, self.bias)
        else:
            out = block_fp8_linear_reference(flat, self.weight, self.weight_scale, self.block, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def fp8_input(self, x: torch.Tensor) -> Fp8Input:
        """The FP8 activations this layer's W8A8 GEMM reads (the norm before it may write them)."""
        from workers.model import fp8_gemm

        return Fp8Input(fp8_gemm.input_group(self.block, self.in_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block.n}x{self.block.k}"


def make_linear(in_features: int, out_features: int, bias: bool, block: BlockShape | None) -> nn.Module:
    """nn.Linear, or an Fp8Linear with scales of this block shape."""
    if block is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return Fp8Linear(in_features, out_features, bias, block)


def rows_scale(scale: torch.Tensor, block: BlockShape, rows: int) -> torch.Tensor:
    """A block scale [..., ceil(rows/bn), kb] as one scale per row [..., rows, kb] (block BlockShape(1, bk)): the
    exact form for row slices and concatenations that do not fall on block boundaries."""
    return scale.repeat_interleave(block.n, dim=-2)[..., :rows, :] if block.n != 1 else scale


def compact_rows_scale(scale: torch.Tensor, bn: int) -> torch.Tensor | None:
    """One scale per row [..., rows, kb] back in blocks of bn rows [..., rows/bn, kb], where every row of each block
    has its block's scale (then the GEMMs load one scale per tile); None where that is not exact."""
    rows = scale.shape[-2]
    if rows % bn:
        return None
    tiles = scale.unflatten(-2, (rows // bn, bn))
    first = tiles[..., :1, :]
    return first.squeeze(-2).contiguous() if bool((tiles == first).all()) else None


@torch.no_grad()
def fuse_linears(linears: list[nn.Module]) -> nn.Module:
    """One linear layer whose output is the given ones' outputs side by side (their weights and biases stacked);
    FP8 layers' scales are stacked too (per row where a part is not a whole number of scale blocks)."""
    if isinstance(linears[0], Fp8Linear):
        return _fuse_fp8(linears)
    weight = torch.cat([lin.weight for lin in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


def _fuse_fp8(linears: list[Fp8Linear]) -> Fp8Linear:
    block = linears[0].block
    weight = torch.cat([lin.weight for lin in linears])
    if all(lin.out_features % block.n == 0 for lin in linears):
        scale, fused_block = torch.cat([lin.weight_scale for lin in linears]), block
    else:
        scale = torch.cat([rows_scale(lin.weight_scale, block, lin.out_features) for lin in linears])
        fused_block = BlockShape(1, block.k)
    has_bias = linears[0].bias is not None
    with torch.device("meta"):
        fused = Fp8Linear(weight.shape[1], weight.shape[0], has_bias, fused_block)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.weight_scale = nn.Parameter(scale, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


class DenseMLP(nn.Module):
    """gate_proj / up_proj are what the checkpoint loads into; fuse_projections() then makes them one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, block: BlockShape | None = None):
        super().__init__()
        self.gate_proj = make_linear(hidden_size, intermediate_size, False, block)
        self.up_proj = make_linear(hidden_size, intermediate_size, False, block)
        self.down_proj = make_linear(intermediate_size, hidden_size, False, block)
        self.gate_up_proj: nn.Module | None = None

    def fuse_projections(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def fp8_input(self, x: torch.Tensor) -> Fp8Input | None:
        """What gate_up_proj reads: FP8 activations (an Fp8Linear), else None."""
        return self.gate_up_proj.fp8_input(x) if isinstance(self.gate_up_proj, Fp8Linear) else None
