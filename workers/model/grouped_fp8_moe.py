"""FP8 MoE experts with per-channel weight scales (the FP8-dynamic checkpoints) through torch's grouped FP8 GEMM.

The pairs (token, chosen expert) are sorted by expert; each token is quantised to e4m3 once, per token (the
format's `input_activations` strategy "token"; by the norm before the block in the same launch where that kernel
runs, norm_quant), and its fp8 row gathered for each of its k pairs; then
`torch._scaled_grouped_mm` (CUTLASS grouped GEMM, row-wise scales: scale_a one per row, scale_b [E, N] one per
expert output channel; https://github.com/pytorch/pytorch, aten/src/ATen/native/cuda/ScaledGroupMM.cu) runs gate_up
over every expert's rows at once, one Triton kernel takes silu(gate) * up and quantises it per row, the second
grouped GEMM runs down, and a Triton kernel sums each token's k outputs times their routing weights.

Numbers: the reference is MoeExperts.grouped (activations rounded per token to e4m3, weights dequantised, float32
products); this path also rounds the gate_up output to the activation dtype before silu (as the Triton path does),
and accumulates with Hopper's fast FP8 accumulation (FAST_ACCUM says why). No host sync anywhere (moe_routing's
pair layout: sort_pairs, or two kernels with the fused launches on), so it runs inside CUDA graphs; `available`
probes torch and the GPU once, before any capture.
"""

from __future__ import annotations

import torch

from workers.model import fp8, fp8_gemm, moe_routing, route_align
from workers.model.fp8 import FP8_DTYPE
from workers.model.fp8_gemm import quantize_tokens
from workers.model.fused_moe import TL_DTYPES
from workers.model.norm_quant import Fp8Rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:
    from workers.model.fp8_gemm import quantize_scaled, row_scale

    @triton.jit
    def _silu_mul(h_ptr, rows, cols, R, I, stride_h, ROUND_TY: tl.constexpr):
        """silu(gate) * up of rows x cols of h [R, 2I] (gate | up), rounded to ROUND_TY, as float32 (0 outside)."""
        mask = (rows[:, None] < R) & (cols[None, :] < I)
        base = h_ptr + rows[:, None] * stride_h + cols[None, :]
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(ROUND_TY).to(tl.float32)

    @triton.jit(do_not_specialize=["R"])
    def _silu_mul_quant_kernel(
        h_ptr, q_ptr, s_ptr, R, I, stride_h, stride_q, ROUND_TY: tl.constexpr, WIDE: tl.constexpr,
        NARROW: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        """Rows [BLOCK_R] of h [R, 2I] (gate | up) -> silu(gate) * up rounded to ROUND_TY, then e4m3 per row. A row's
        columns in two power-of-two pieces, [0, WIDE) and [WIDE, WIDE + NARROW) (NARROW 0: one piece), so that
        768 = 512 + 256 runs no idle lanes (one piece of 1,024 left a quarter of them masked)."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        wide = tl.arange(0, WIDE)
        act = _silu_mul(h_ptr, rows, wide, R, I, stride_h, ROUND_TY)
        amax = tl.max(tl.abs(act), axis=1)
        if NARROW > 0:
            narrow = WIDE + tl.arange(0, NARROW)
            rest = _silu_mul(h_ptr, rows, narrow, R, I, stride_h, ROUND_TY)
            amax = tl.maximum(amax, tl.max(tl.abs(rest), axis=1))
        scale = row_scale(amax)
        out = q_ptr + rows[:, None] * stride_q
        q = quantize_scaled(act, scale)
        tl.store(out + wide[None, :], q.to(q_ptr.dtype.element_ty), mask=(rows[:, None] < R) & (wide[None, :] < I))
        if NARROW > 0:
            q = quantize_scaled(rest, scale)
            tl.store(out + narrow[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=(rows[:, None] < R) & (narrow[None, :] < I))
        tl.store(s_ptr + rows, scale, mask=rows < R)

    @triton.jit
    def _combine_kernel(
        ys_ptr, pos_ptr, w_ptr, ids_ptr, out_ptr, H, num_experts, stride_y, stride_o, TOP_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[t, cols] = sum_j w[t, j] * ys[pos[t * k + j], cols], pairs whose expert is num_experts (foreign) adding
        zero; float32 sum, rounded once to out's dtype."""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = t * TOP_K + j
            row = tl.load(pos_ptr + pair).to(tl.int64)
            weight = tl.load(w_ptr + pair).to(tl.float32)
            local = tl.load(ids_ptr + pair) < num_experts
            y = tl.load(ys_ptr + row * stride_y + cols, mask=cmask & local, other=0.0).to(tl.float32)
            acc += y * weight
        tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# torch's grouped FP8 GEMM with Hopper's fast accumulation (the MMA's reduced-precision accumulator, as vLLM's
# CUTLASS sm90 FP8 schedules use it): on the H200, 30B-A3B experts at 8,192 tokens, 1,164 us with it and 2,668 us
# without (bf16 Triton 1,276). The price: bf16 outputs that cross an e4m3 rounding boundary of the next quantisation,
# 1-2% relative against the float32-accumulating reference (the dense row-wise GEMM keeps float32 accumulation:
# fp8_gemm.FAST_ACCUM).
FAST_ACCUM = True


def silu_mul_quantize(h: torch.Tensor, round_to: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, 2I] (gate then up columns) -> (e4m3 [R, I], scales float32 [R]): silu(gate) * up rounded to round_to,
    quantised per row. Off CUDA/Triton: the torch reference."""
    inter = h.shape[1] // 2
    if not fp8_gemm.on_triton(h):
        return silu_mul_quantize_reference(h, round_to)
    rows = h.shape[0]
    q = torch.empty(rows, inter, dtype=FP8_DTYPE, device=h.device)
    s = torch.empty(rows, dtype=torch.float32, device=h.device)
    if rows:
        wide, narrow = row_pieces(inter)
        block_r = max(1, min(16, 2048 // triton.next_power_of_2(inter)))
        _silu_mul_quant_kernel[(triton.cdiv(rows, block_r),)](
            h, q, s, rows, inter, h.stride(0), q.stride(0), ROUND_TY=getattr(tl, TL_DTYPES[round_to]), WIDE=wide,
            NARROW=narrow, BLOCK_R=block_r, num_warps=4,
        )
    return q, s


def row_pieces(n: int) -> tuple[int, int]:
    """n columns as two power-of-two pieces (wide, narrow): the largest power of two within n, then the rest
    rounded up to one (0 when n is a power of two). 768 -> (512, 256), 1,536 -> (1,024, 512): no idle lanes."""
    wide = 1 << (n.bit_length() - 1)
    rest = n - wide
    return wide, 0 if rest == 0 else 1 << (rest - 1).bit_length()


def silu_mul_quantize_reference(h: torch.Tensor, round_to: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = h.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(round_to)
    q, s = fp8.quantize_activation_groups(act, act.shape[1])
    return q, s.view(-1)


def combine(
    ys: torch.Tensor, pos: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, num_experts: int,
) -> torch.Tensor:
    """ys [pairs (sorted), H], pos [T * k] (each pair's row in ys), top_w/top_i [T, k] -> [T, H]: each token's k
    rows times their weights, summed; a pair with top_i == num_experts (another rank's) adds zero."""
    tokens, k = top_i.shape
    hidden = ys.shape[1]
    if not fp8_gemm.on_triton(ys):
        return combine_reference(ys, pos, top_w, top_i, num_experts)
    out = ys.new_empty(tokens, hidden)
    if tokens:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
            ys, pos, top_w.contiguous(), top_i.contiguous(), out, hidden, num_experts, ys.stride(0), out.stride(0),
            TOP_K=k, BLOCK_H=block_h, num_warps=4,
        )
    return out


def combine_reference(ys, pos, top_w, top_i, num_experts) -> torch.Tensor:
    tokens, k = top_i.shape
    y = ys[pos].view(tokens, k, -1).float()
    y = torch.where((top_i < num_experts).unsqueeze(-1), y, 0.0)
    return (y * top_w.float().unsqueeze(-1)).sum(dim=1).to(ys.dtype)


def grouped_fp8_experts(
    x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    gate_up_scale: torch.Tensor, down_scale: torch.Tensor, foreign: bool = False, x_fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    """x [T, H]; top_w/top_i [T, k]; gate_up_proj [E, 2I, H] and down_proj [E, H, I] float8_e4m3fn with per-row
    scales gate_up_scale [E, 2I, 1], down_scale [E, H, 1] -> [T, H]. foreign: top_i may hold E (another rank's).
    x_fp8: x already quantised per token (the norm before the block did it in its launch: fp8_gemm.token_group)."""
    num_experts = gate_up_proj.shape[0]
    xq, xs = quantize_tokens(x) if x_fp8 is None else token_rows(x_fp8, x)
    rows = pair_layout(top_i, num_experts, foreign, xs)
    h = torch._scaled_grouped_mm(
        xq[rows.source], gate_up_proj.transpose(1, 2), rows.row_scales, gate_up_scale.view(num_experts, -1),
        offs=rows.offs, out_dtype=x.dtype, use_fast_accum=FAST_ACCUM,
    )
    act_q, act_s = silu_mul_quantize(h, x.dtype)
    ys = torch._scaled_grouped_mm(
        act_q, down_proj.transpose(1, 2), act_s, down_scale.view(num_experts, -1), offs=rows.offs, out_dtype=x.dtype,
        use_fast_accum=FAST_ACCUM,
    )
    return combine(ys, rows.pos, top_w, top_i, num_experts)


def pair_layout(top_i: torch.Tensor, num_experts: int, foreign: bool, token_scales: torch.Tensor
                ) -> moe_routing.PairLayout:
    """The pairs' rows for the grouped GEMMs: moe_routing's two-launch kernels where the fused routing launches are
    on (route_align.FUSED, bench_engine --layer-fusions), else its torch reference (sort_pairs and index ops)."""
    if route_align.FUSED and moe_routing.on_triton(top_i):
        return moe_routing.pair_layout_triton(top_i, num_experts, foreign, token_scales)
    return moe_routing.pair_layout_reference(top_i, num_experts, foreign, token_scales)


def token_rows(x_fp8: Fp8Rows, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows, scales [T, 1]) of rows quantised elsewhere, checked to be x's, one scale a token."""
    if tuple(x_fp8.q.shape) != tuple(x.shape) or x_fp8.group < x.shape[1] or x_fp8.dtype != x.dtype:
        raise ValueError(f"the grouped FP8 experts read {x.dtype} rows {tuple(x.shape)} quantised one scale a token; got "
                         f"{x_fp8.dtype} e4m3 rows {tuple(x_fp8.q.shape)} in groups of {x_fp8.group} columns")
    return x_fp8.q, x_fp8.scales


def available(device: torch.device) -> bool:
    """Whether torch._scaled_grouped_mm runs row-wise fp8 on this GPU with uneven expert groups and gives the
    reference's numbers (checked once per device on a small layer, then remembered: fp8_gemm.probed; the reason of
    a failure in fp8_gemm.PROBE_FAILURES["grouped"]). Call it before any CUDA graph capture: the check syncs."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return fp8_gemm.probed(_WORKS, _probe_grouped, device)


def _probe_grouped(device: torch.device, gen: torch.Generator) -> None:
    from workers.checkpoint_quant import BlockShape
    from workers.model.fp8 import dequantize_weight_blocks

    experts, hidden, inter, tokens, k = 8, 256, 128, 37, 4  # 37 x 4 pairs: uneven groups, some possibly empty
    block = BlockShape(1, 1 << 30)
    gu, gus = fp8.quantize_weight_blocks(torch.randn(experts, 2 * inter, hidden, device=device, generator=gen) * 0.05, block)
    dn, dns = fp8.quantize_weight_blocks(torch.randn(experts, hidden, inter, device=device, generator=gen) * 0.05, block)
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    top_i = torch.rand(tokens, experts, device=device, generator=gen).topk(k, dim=-1).indices
    top_w = torch.rand(tokens, k, device=device, generator=gen).bfloat16()
    got = grouped_fp8_experts(x, top_w, top_i, gu, dn, gus, dns).float()
    want = torch.zeros(tokens, hidden, device=device)
    w_gu, w_dn = dequantize_weight_blocks(gu, gus, block), dequantize_weight_blocks(dn, dns, block)
    a = fp8.fake_quantize_activations(x, hidden)
    for t in range(tokens):
        for j in range(k):
            e = int(top_i[t, j])
            gate, up = (a[t] @ w_gu[e].t()).chunk(2)
            act = fp8.fake_quantize_activations((torch.nn.functional.silu(gate) * up).bfloat16()[None], inter)[0]
            want[t] += float(top_w[t, j]) * (act @ w_dn[e].t())
    err = ((got - want).norm() / want.norm()).item()
    if not err < 2e-2:
        raise ValueError(f"grouped fp8 experts differ from the reference by {err:.3g} (relative)")


_WORKS: dict[int, bool] = {}
