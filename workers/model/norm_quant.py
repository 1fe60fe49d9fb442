"""RMSNorm, with the residual add before it, and the FP8 quantisation of its output after it, as one Triton kernel:
what the next W8A8 GEMM reads (e4m3 rows and float32 scales per token and group of columns) written straight from
the row the norm holds in registers, so the normed rows never go to memory and back and the quantisation is no
launch of its own. A consumer that also reads the normed rows themselves (the MoE router's bf16 GEMM beside the FP8
experts) gets them from the same kernel.

Numbers: the sum and the norm round where fused_norm_rope's kernels round (as transformers does), and the
quantisation is fp8_gemm.quantize_group's (IEEE division, round to nearest even on e4m3's grid): the kernel writes
bit for bit what add_rms_norm followed by quantize_activations write; add_norm_quantize_reference is the same in
torch (fp8.quantize_activation_groups of layers.rms_norm_reference). The same fusion elsewhere: FlashInfer's
fused_add_rmsnorm_fp8_block_quant (residual add, RMSNorm, 1x128 FP8 block quantisation in one pass, the normed rows
written too: https://docs.flashinfer.ai/generated/flashinfer.norm.fused_add_rmsnorm_fp8_block_quant.html) and vLLM's
compile-time pattern FusedAddRMSNormDynamicQuantPattern (per-token dynamic scales:
https://docs.vllm.ai/en/v0.15.0/api/vllm/compilation/fusion/); this kernel is written from the formulas above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model import fp8
from workers.model.fp8 import FP8_DTYPE
from workers.model.fused_norm_rope import rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:
    from workers.model.fp8_gemm import quantize_group
    from workers.model.fused_norm_rope import _load_row_sum, _norm_row

MAX_HIDDEN = 16384  # one row per program, held in registers
# False: the norm and the quantisation launch apart, as before this kernel.
# Off: measured with route_align's and norm_quant's kernels together (benchmarks/README.md, run89-90, one H200), they
# took 192 launches out of a batch-256 decode step and none of its GPU time, and an 8k-token prefill step went from
# 92.8 to 94.9 ms. Small decode batches, where a launch's fixed cost weighs most, are not measured yet
# (bench_engine --layer-fusions both --decode-batches ...). bench_engine --layer-fusions on|both sets it.
# Since then the fused norm's kernel reads and writes 16-byte pieces: in run151's 8k-token prefill step (one H100,
# the forty-fourth pass) it took 36 us a call, where the norm (41 us) and the quantisation (24 us) it replaces took
# 65. On or off is for --layer-fusions both to decide, on a GPU, before the default changes.
FUSED = False


@dataclass(frozen=True)
class Fp8Rows:
    """Activations as a W8A8 GEMM reads them: e4m3 `q` [T, K], float32 `scales` [T, ceil(K/group)] (one per token and
    group of `group` columns), `dtype` the activation dtype they stand for; `rows`: the activations themselves, where
    a consumer reads those too (else None)."""

    q: torch.Tensor
    scales: torch.Tensor
    group: int
    dtype: torch.dtype
    rows: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass(frozen=True)
class Fp8Input:
    """What a layer reading FP8 activations wants from the norm before it: their group of columns (a power of two),
    and whether it reads the normed rows themselves too."""

    group: int
    rows_too: bool = False


def supports(x: torch.Tensor, group: int) -> bool:
    """Whether the fused kernel runs for rows like x and quantisation groups of `group` columns."""
    n = x.shape[-1]
    return (FUSED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.dim() == 2 and x.stride(-1) == 1 and n <= MAX_HIDDEN and group & (group - 1) == 0
            and group <= triton.next_power_of_2(n))


def add_norm_quantize_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group: int,
) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows]:
    """(normed rows, x + residual (x without one), their Fp8Rows with the rows): the unfused torch computation."""
    total = x if residual is None else residual + x
    normed = rms_norm_reference(total, weight, eps)
    q, scales = fp8.quantize_activation_groups(normed, group)
    return normed, total, Fp8Rows(q, scales, group, x.dtype, normed)


if triton is not None:

    @triton.jit
    def _add_norm_quant_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, n, eps,
        stride_x, stride_r, stride_o, stride_ro, stride_q, stride_s,
        HAS_RESIDUAL: tl.constexpr, WRITE_ROWS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One row per program: s = x (+ r, rounded; stored to res_out), normed = RMSNorm(s) * w (stored to out when
        WRITE_ROWS), then e4m3 per group of GROUP columns with their scales. Masked columns are 0: no effect on a
        group's amax."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        s = _load_row_sum(x_ptr, r_ptr, res_out_ptr, row, offs, mask, stride_x, stride_r, stride_ro, HAS_RESIDUAL)
        normed = _norm_row(s, w_ptr, offs, mask, n, eps)
        if WRITE_ROWS:
            tl.store(out_ptr + row * stride_o + offs, normed, mask=mask)
        q, scale = quantize_group(tl.reshape(normed.to(tl.float32), (BLOCK // GROUP, GROUP)))
        tl.store(q_ptr + row * stride_q + offs, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=mask)
        groups = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + row * stride_s + groups, scale, mask=groups * GROUP < n)


def add_norm_quantize(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, want: Fp8Input,
    out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
) -> tuple[Fp8Rows, torch.Tensor]:
    """x [T, hidden] (residual [T, hidden] or None) -> (Fp8Rows of RMSNorm(x + residual) * weight in groups of
    want.group columns, with the normed rows when want.rows_too; x + residual, or x itself without a residual). One
    launch (supports() says when it runs). out / res_out: where to write the normed rows / the sum (res_out may be
    residual itself: each program reads its row whole before it writes it)."""
    t, n = x.shape
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual of shape {tuple(residual.shape)} for rows of shape {tuple(x.shape)}")
    group, block = want.group, triton.next_power_of_2(n)
    rows = None
    if want.rows_too:
        rows = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    total = x
    if residual is not None:
        total = res_out if res_out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    q = torch.empty(t, n, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(t, -(-n // group), dtype=torch.float32, device=x.device)
    if t:
        r, o = residual if residual is not None else x, rows if rows is not None else x
        _add_norm_quant_kernel[(t,)](
            x, r, weight, o, total, q, scales, n, eps,
            x.stride(0), r.stride(0), o.stride(0), total.stride(0), q.stride(0), scales.stride(0),
            HAS_RESIDUAL=residual is not None, WRITE_ROWS=rows is not None, GROUP=group, BLOCK=block,
            num_warps=min(max(block // 512, 1), 8),
        )
    return Fp8Rows(q, scales, group, x.dtype, rows), total
