"""FP8 dense linears on CUDA: activation quantisation on the fly (per token and group of 128 against block-scaled
weights, per token against per-channel ones: fp8.activation_group) and three GEMMs: torch._scaled_mm with blockwise
scales (the block format), torch._scaled_mm with row-wise scales (per-channel weights, per-token activations), each
behind a probe of this torch and GPU, and a block-scaled W8A8 GEMM in Triton where those are missing; elsewhere the
torch references of workers/model/fp8.py.

Numbers: quantize_activations equals fp8.quantize_activation_groups bit for bit (IEEE division: div_rn for the
scale, the row's reciprocal and an FMA correction for the quotient, divide_by_row; e4m3 rounding to nearest even).
The GEMMs accumulate fp8 x fp8 products in float32 per K block of 128 and apply x_scale[m, kb] * w_scale[n //
block.n, kb] per block (DeepSeek-V3 `inference/kernel.py` `fp8_gemm_kernel`, vLLM `w8a8_triton_block_scaled_mm`:
https://github.com/vllm-project/vllm, file vllm/model_executor/layers/quantization/utils/fp8_utils.py), or,
row-wise, x_scale[m] * w_scale[n] once after the whole K sum (vLLM `cutlass_scaled_mm`); against the reference,
which dequantises both operands first, they differ by float32 rounding and accumulation order only (FAST_ACCUM says
why Hopper's fast FP8 accumulation is off). Every launch's shapes are fixed by M, with no host sync, so all of it
runs inside CUDA graphs.

Measured on the H200 (benchmarks/README.md, eleventh pass, run52): at 8,192 tokens the 30B-A3B q/k/v GEMM takes
226 us in bf16, 176 us blockwise through torch._scaled_mm, 163 us row-wise and 310 us in the Triton kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from workers.model import fp8
from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ACT_GROUP = 128  # activation columns per scale, and the GEMM's BLOCK_K: one scale pair per K tile
BACKENDS = ("auto", "triton", "scaled_mm")  # auto: torch._scaled_mm where its probe passes, else Triton


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # GROUP_M row blocks go through every column block before the next group (L2 reuse of A)


def gemm_config(m: int) -> GemmConfig:
    """Tiles by token count: decode batches stream the weights (narrow column tiles, many programs); prefill
    steps of 1k-16k rows take 128 x 128 tiles (fp8: 32 KiB of A and B per stage, three stages)."""
    if m <= 16:
        return GemmConfig(16, 64, 4, 4)
    if m <= 64:
        return GemmConfig(32, 64, 4, 4)
    if m <= 256:
        return GemmConfig(64, 128, 4, 4)
    # H200 sweep (scripts/tune_fp8.py, benchmarks/README.md): at 8,192 rows 64 x 128, 4 warps, 3 stages beat 128 x 128
    # x 8 warps by 14% (q/k/v 284 against 331 us; o 219 against 251).
    return GemmConfig(64, 128, 4, 3)


def on_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


if triton is not None:
    # Globals a jitted function reads must be constexpr.
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _AMAX_FLOOR = tl.constexpr(fp8.ACTIVATION_AMAX_FLOOR)
    # Triton's CPU interpreter (TRITON_INTERPRET=1, read when Triton starts) casts to e4m3 wrongly: round_to_e4m3
    # rounds first there. A GPU's cast (cvt.rn.satfinite.e4m3x2.f32 on sm_90) rounds to nearest even itself.
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def round_to_e4m3(v):
        """v (float32, within +-448) rounded to nearest even on e4m3's grid, still float32, so the cast to fp8 that
        follows is exact. The hardware cast rounds the same; this form is here because Triton 3.6's interpreter
        casts wrongly when the mantissa carries into an odd exponent (7.9 -> 4.0) and rounds ties away from zero.
        Adding 2^(e + 20) (e: v's binade, at least e4m3's smallest normal -6) leaves one float32 ulp = 2^(e - 3),
        e4m3's spacing there; subtracting it again is exact."""
        bits = v.to(tl.int32, bitcast=True)
        binade = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        magic = ((binade + 20 + 127) << 23).to(tl.float32, bitcast=True)
        r = (tl.abs(v) + magic) - magic
        # v's sign bit put back as a bit (negation would give +0.0 for a negative value rounded to zero; torch: -0.0)
        return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def divide_by_row(x, d):
        """x [rows, n] / d [rows], IEEE-rounded as div_rn, with one division a row: the row's reciprocal y, rounded
        once, then x * y corrected by its residual x - d (x y), which an FMA computes exactly (the correction step
        of P. Markstein, "Computation of elementary functions on the IBM RISC System/6000 processor", IBM J. Res.
        Dev. 34(1), 1990; also the last step of div.rn's own sequence). div_rn a value took ~10 instructions and a
        branch to its slow path (sm_90 SASS: MUFU.RCP, FFMAs, FCHK), this three; the slow path covers quotients near
        the float32 range's ends, which a quantisation's (at most 448, and below e4m3's smallest subnormal rounding
        to 0) are not."""
        db = tl.broadcast_to(d[:, None], x.shape)
        y = tl.broadcast_to(tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)[:, None], x.shape)
        q = x * y
        return tl.where(x == 0.0, x, tl.fma(tl.fma(-q, db, x), y, q))  # -0.0 / d is -0.0 (the correction gives +0.0)

    @triton.jit
    def quantize_group(x):
        """x [rows, GROUP] float32 -> (e4m3 grid values float32 [rows, GROUP], scales [rows]) as the reference."""
        scale = row_scale(tl.max(tl.abs(x), axis=1))
        return quantize_scaled(x, scale), scale

    @triton.jit
    def row_scale(amax):
        """A row's e4m3 scale from its largest magnitude (floored, as the reference)."""
        amax = tl.maximum(amax, _AMAX_FLOOR)
        return tl.math.div_rn(amax, tl.full(amax.shape, _FP8_MAX, tl.float32))

    @triton.jit
    def quantize_scaled(x, scale):
        """x [rows, n] float32 over its rows' scales [rows] -> values on e4m3's grid (float32), as the reference."""
        q = divide_by_row(x, scale)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
        if _INTERPRETED:
            q = round_to_e4m3(q)
        return q

    @triton.jit(do_not_specialize=["M"])
    def _quantize_kernel(
        x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        """Grid (rows / BLOCK_M, groups): one [BLOCK_M, GROUP] tile; masked columns read 0 (no effect on amax)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        group = tl.program_id(1)
        offs_k = group * GROUP + tl.arange(0, GROUP)
        rows = offs_m.to(tl.int64)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = quantize_group(x)
        tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows * stride_sm + group, scale, mask=offs_m < M)

    @triton.jit(do_not_specialize=["M"])
    def _w8a8_gemm_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, block_n, block_k,
        stride_am, stride_asm, stride_bn, stride_bsn, stride_bsk, stride_cm,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        """c = a @ b.T with a [M, K] fp8 (scales [M, K / BLOCK_K]) and b [N, K] fp8 (scales [N / block_n, K / block_k],
        block_k a multiple of BLOCK_K or >= K). The weight scale is loaded per output column (n // block_n), which
        serves block_n 1, 128 or any other size alike; the loads hit L1 after the first row of the tile."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = pid // in_group * GROUP_M
        rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + pid % in_group % rows_in_group
        pid_n = pid % in_group // rows_in_group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
        bs_ptrs = bs_ptr + (offs_n // block_n) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:  # no K mask: the loads stay unpredicated along K
                a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb, mask=m_mask, other=0.0)
            b_s = tl.load(bs_ptrs + (kb * BLOCK_K // block_k) * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


QUANT_BLOCK_M = 16  # rows per program at groups of 128 columns; wider groups take fewer (_quant_rows)


def _quant_rows(group: int) -> int:
    """Rows per quantisation program: 2,048 elements a tile (16 x 128; one row of a per-token group of 2,048)."""
    return max(1, min(QUANT_BLOCK_M, 2048 // group))


def quantize_activations(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (float8_e4m3fn [M, K], scales float32 [M, ceil(K/group)]), per token and group
    of columns; bit-equal to fp8.quantize_activation_groups (the Triton kernel on CUDA, that function elsewhere)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activations takes [tokens, features], got shape {tuple(x.shape)}")
    if not on_triton(x):
        return fp8.quantize_activation_groups(x, group)
    if group & (group - 1):
        raise ValueError(f"activation group {group} is not a power of two")
    m, k = x.shape
    groups = -(-k // group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    x = x if x.stride(1) == 1 else x.contiguous()
    rows = _quant_rows(group)
    _quantize_kernel[(triton.cdiv(m, rows), groups)](
        x, q, scales, m, k, x.stride(0), q.stride(0), scales.stride(0),
        GROUP=group, BLOCK_M=rows, num_warps=4,
    )
    return q, scales


def token_group(k: int) -> int:
    """The quantisation group that makes one scale a token of k columns: the power of two >= k."""
    return 1 << max(0, k - 1).bit_length()


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], scales float32 [M, 1]): one scale per token (per-channel weights' activations);
    bit-equal to fp8.quantize_activation_groups(x, K)."""
    k = x.shape[-1]
    if not on_triton(x):
        return fp8.quantize_activation_groups(x, k)
    return quantize_activations(x, token_group(k))


def per_channel(block: BlockShape, k: int) -> bool:
    """Whether weights in `block`s over K = k have one scale per output row (and so per-token activations)."""
    return block.n == 1 and fp8.activation_group(block, k) == k


def input_group(block: BlockShape, k: int) -> int:
    """The columns per activation scale fp8_linear quantises x in against weights in `block`s over K = k: per token
    (a power of two >= k, one group, as quantize_tokens) against per-channel weights, else ACT_GROUP."""
    return token_group(k) if per_channel(block, k) else ACT_GROUP


def _check_weight(weight: torch.Tensor, scale: torch.Tensor, block: BlockShape, k: int) -> None:
    n = weight.shape[0]
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"fp8_linear needs a row-major float8_e4m3fn weight [N, {k}], got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    if tuple(scale.shape) != block.grid(n, k) or scale.dtype != torch.float32:
        raise ValueError(
            f"weight scale {scale.dtype} {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} in blocks of "
            f"{block.n}x{block.k} (expected float32 {block.grid(n, k)})"
        )
    if block.k % ACT_GROUP and block.k < k:
        raise ValueError(f"weight block {block.n}x{block.k}: block.k must be a multiple of {ACT_GROUP} or cover K={k}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: BlockShape, bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: x quantised per token (per-channel weights) or per token and group of 128
    (block scales), times the fp8 weight. backend: "triton" (the Triton GEMM), "scaled_mm" or "auto" (torch._scaled_mm,
    row-wise or blockwise, where its probe passes and the shape fits, else Triton). Off CUDA: the reference."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8_linear backend {backend!r} is not one of {BACKENDS}")
    if x.dim() != 2:
        raise ValueError(f"fp8_linear takes x [tokens, features], got shape {tuple(x.shape)}")
    k = x.shape[1]
    _check_weight(weight, scale, block, k)
    if not on_triton(x):
        return fp8.block_fp8_linear_reference(x, weight, scale, block, bias)
    xq, xs = quantize_activations(x, input_group(block, k))
    return fp8_linear_quantized(xq, xs, weight, scale, block, x.dtype, bias, backend)


def fp8_linear_quantized(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: BlockShape,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """fp8_linear's GEMM on activations already quantised (xq [M, K] e4m3, xs [M, ceil(K / input_group(block, K))]
    float32, on CUDA): what the norm before a layer writes in one kernel with its output (workers/model/norm_quant.py)."""
    m, k = xq.shape
    n = weight.shape[0]
    if tuple(xs.shape) != (m, -(-k // input_group(block, k))):
        raise ValueError(f"activation scales {tuple(xs.shape)} for rows {tuple(xq.shape)}: expected groups of "
                         f"{input_group(block, k)} columns")
    library = backend != "triton" and m > 0 and xq.is_cuda  # torch's FP8 GEMMs (CUDA only; probed once a device)
    if per_channel(block, k):
        if library and rowwise_fits(n, k, out_dtype) and rowwise_available(xq.device):
            return scaled_mm_rowwise(xq, xs, weight, scale, out_dtype, bias)
        return w8a8_gemm(xq, xs.expand(m, -(-k // ACT_GROUP)).contiguous(), weight, scale, block, out_dtype, bias)
    if library and scaled_mm_fits(n, k, block, out_dtype, m) and scaled_mm_available(xq.device):
        return scaled_mm_blockwise(xq, xs, weight, scale, out_dtype, bias)
    return w8a8_gemm(xq, xs, weight, scale, block, out_dtype, bias)


def w8a8_gemm(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: BlockShape,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None, cfg: GemmConfig | None = None,
) -> torch.Tensor:
    """The Triton GEMM on already quantised activations (xq [M, K] fp8, xs [M, ceil(K/128)]); cfg: tiles other than
    gemm_config(M)'s (scripts/tune_fp8.py)."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    cfg = cfg or gemm_config(m)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _w8a8_gemm_kernel[grid](
        xq, xs, weight, scale, bias if bias is not None else out, out, m, n, k, block.n, block.k,
        xq.stride(0), xs.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=ACT_GROUP,
        GROUP_M=cfg.group_m, EVEN_K=k % ACT_GROUP == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# torch._scaled_mm with blockwise scales. Layouts from torch's own checks (torch/_meta_registrations.py,
# `_check_scaled_mm_sizes_v2`, https://github.com/pytorch/pytorch): a [M, K] row-major fp8, b [K, N] column-major
# (our [N, K] weight transposed); recipe BlockWise1x128 for a: scales [M, K/128] with strides (1, M); for b either
# BlockWise128x128: scales [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to 4, or BlockWise1x128:
# scales [N, K/128] with strides (1, N). K and N must be multiples of 128 (the recipes divide them), M any.


def scaled_mm_fits(n: int, k: int, block: BlockShape, dtype: torch.dtype, m: int = 4) -> bool:
    """The blockwise recipe's shapes. M: cuBLAS (torch 2.11, CUDA 13, H200) answered NOT_SUPPORTED for M 1 and 2
    and ran M 4, 8, 16, 24, 32, 64, 100 and 256; so multiples of 4 only (a decode step of 1-3 or 5 tokens takes
    the Triton GEMM)."""
    return dtype == torch.bfloat16 and n % 128 == 0 and k % 128 == 0 and (block.n == 1 or block.n == 128) and (
        block.k == 128 or block.k >= k) and m % 4 == 0


def _scaled_mm_scales(xs: torch.Tensor, scale: torch.Tensor, n: int, k: int):
    """The scale tensors in the strides torch wants, and whether the weight's recipe is 128x128 (else 1x128)."""
    kb = k // 128
    sa = xs.t().contiguous().t()
    if scale.shape[0] == n:  # one row per scale: 1x128 (a per-channel scale repeats over the K groups)
        sb = scale.expand(n, kb) if scale.shape[1] == 1 else scale
        return sa, sb.t().contiguous().t(), False
    l4 = -(-kb // 4) * 4
    sb = scale.new_zeros(scale.shape[0], l4)
    sb[:, :kb] = scale
    return sa, sb.t(), True


def scaled_mm_blockwise(
    x_fp8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_fp8 [M, K] with per-token-group scales [M, K/128] times weight [N, K] with 128x128 block scales
    [N/128, K/128] (or one per row and 128 columns, [N, K/128] or [N, 1]) through torch's blockwise CUTLASS kernels.
    Raises whatever torch raises where this torch or GPU lacks them (scaled_mm_available catches it)."""
    n, k = weight.shape
    sa, sb, square = _scaled_mm_scales(x_scales, scale, n, k)
    if x_fp8.device.type == "meta" or not square:
        # the explicit-recipe API: torch's layout checks without a GPU (the tests), and 1x128 weight scales, which
        # torch._scaled_mm's shape inference refused on the H200 ("Invalid scaling configuration")
        recipe = torch.nn.functional.ScalingType
        out = torch.nn.functional.scaled_mm(
            x_fp8, weight.t(), sa, recipe.BlockWise1x128, sb, recipe.BlockWise128x128 if square else recipe.BlockWise1x128,
            output_dtype=out_dtype,
        )
    else:
        # torch._scaled_mm reads the same recipes from the scales' shapes and strides; on the H200 (torch 2.11) it ran
        # 20 us where F.scaled_mm took 57 (m = 64, K 2,048), the latter's argument handling a fixed cost per call.
        out = torch._scaled_mm(x_fp8, weight.t(), sa, sb, out_dtype=out_dtype)
    return out if bias is None else out + bias


def rowwise_fits(n: int, k: int, dtype: torch.dtype) -> bool:
    """torch's row-wise FP8 GEMM: bf16 output, N and K multiples of 16 (its CUTLASS kernel's alignment)."""
    return dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def scaled_mm_rowwise(
    x_fp8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_fp8 [M, K] with per-token scales [M, 1] times weight [N, K] with per-row scales [N, 1]: torch._scaled_mm's
    row-wise recipe (scale_a [M, 1], scale_b [1, N], float32), bias fused, fast accumulation."""
    return torch._scaled_mm(x_fp8, weight.t(), x_scales, scale.view(1, -1), bias=bias, out_dtype=out_dtype,
                            use_fast_accum=FAST_ACCUM)


# Hopper's fast FP8 accumulation (the MMA's own reduced-precision accumulator, DeepSeek-V3 report §3.3.2: ~14 bits)
# in torch's row-wise GEMMs: off. On the H200 it took the 8,192-token q/k/v GEMM from 153 to 125 us, but moved
# bf16 outputs across e4m3 rounding boundaries downstream (the grouped MoE left its 1% bound against the reference).
FAST_ACCUM = False


PROBE_SHAPE = (256, 512)  # (N, K): K / 128 = 4, so the blockwise recipe's scale padding is not exercised


def _probe_blockwise(device: torch.device, gen: torch.Generator) -> None:
    n, k = PROBE_SHAPE
    for block in (BlockShape(128, 128), BlockShape(1, 128)):
        w, s = fp8.quantize_weight_blocks(torch.randn(n, k, device=device, generator=gen), block)
        for m in (4, 24, 256):
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            xq, xs = quantize_activations(x)
            _expect_reference(scaled_mm_blockwise(xq, xs, w, s, torch.bfloat16), x, w, s, block, f"blockwise {block}, m {m}")


def _probe_rowwise(device: torch.device, gen: torch.Generator) -> None:
    n, k = PROBE_SHAPE
    block = BlockShape(1, k)
    w, s = fp8.quantize_weight_blocks(torch.randn(n, k, device=device, generator=gen), block)
    for m in (1, 24, 256):
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        xq, xs = quantize_tokens(x)
        _expect_reference(scaled_mm_rowwise(xq, xs, w, s, torch.bfloat16), x, w, s, block, f"row-wise, m {m}")


def _expect_reference(got, x, w, s, block, what) -> None:
    want = fp8.block_fp8_linear_reference(x, w, s, block).float()
    if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
        raise ValueError(f"{what}: max error {(got.float() - want).abs().max().item():.3g} against the reference")


def probed(cache: dict[int, bool], probe, device: torch.device) -> bool:
    """probe(device, generator) run once per CUDA device and remembered in cache (True unless it raised; the reason
    then in PROBE_FAILURES under the probe's name less its "_probe_"). The probes sync, so this refuses to run one
    while a CUDA graph is being captured."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in cache:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{probe.__name__}: probe the device before capturing a CUDA graph")
        gen = torch.Generator(device=torch.device("cuda", index)).manual_seed(0)
        try:
            probe(torch.device("cuda", index), gen)
            cache[index] = True
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as err:
            cache[index] = False
            PROBE_FAILURES[probe.__name__.removeprefix("_probe_")] = f"{type(err).__name__}: {str(err)[:300]}"
    return cache[index]


def scaled_mm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs blockwise fp8 on this GPU and gives the reference's numbers: checked once per
    device on small shapes (both weight recipes, M 4, 24 and 256), then remembered (a failure's reason in
    PROBE_FAILURES). The check syncs, so its first call must come before any CUDA graph capture (the engine's
    warm-up)."""
    return probed(_SCALED_MM_WORKS, _probe_blockwise, device)


def rowwise_available(device: torch.device) -> bool:
    """As scaled_mm_available, for the row-wise recipe (per-channel weights)."""
    return probed(_ROWWISE_WORKS, _probe_rowwise, device)


PROBE_FAILURES: dict[str, str] = {}  # "blockwise" / "rowwise" / "grouped": why a probe failed (logs, benchmarks' JSON)
_ROWWISE_WORKS: dict[int, bool] = {}
_SCALED_MM_WORKS: dict[int, bool] = {}
