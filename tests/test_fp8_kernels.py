"""The FP8 Triton kernels give what their torch references (workers/model/fp8.py) give: activation quantisation bit
for bit, the block-scaled W8A8 GEMM and the fp8 fused MoE (W8A8 tiled, W8A16 GEMV) to float32 rounding (Triton's
interpreter on CPU with TRITON_INTERPRET=1; the H200 shapes are in test_fp8_kernels_gpu.py).

Triton 3.6's interpreter loads float8_e4m3fn, upcasts it exactly and runs fp8 tl.dot (in float16, exact for e4m3
products, float32 accumulation), but casts float32 to bfloat16 by truncation (torch rounds to nearest even), so the
interpreted kernels run on float32 activations here; the bf16 rounding points are checked on the GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from workers.model import fp8, fp8_gemm, fused_moe
from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import FP8_DTYPE

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and fp8_gemm.triton is not None
interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1")


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The Triton paths on CPU tensors (the interpreter runs them)."""
    monkeypatch.setattr(fp8_gemm, "on_triton", lambda t: True)


def wide_range_activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Columns spanning 1e-4 .. 1e3, one all-zero group (the amax floor) and a -0.0 (its sign survives)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-4, 3, k)
    x[min(1, m - 1), :128] = 0.0
    x[0, 5] = -0.0
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@interpreter
@pytest.mark.parametrize("m,k,dtype", [(17, 256, torch.float32), (5, 300, torch.bfloat16), (1, 100, torch.float16)],
                         ids=["even-fp32", "ragged-groups-bf16", "one-short-group-fp16"])
def test_activation_quantization_kernel_is_bit_equal_to_the_reference(kernels_on_cpu, m, k, dtype):
    """The bound is zero: the kernel divides with IEEE rounding (div_rn) as torch does, and rounds to e4m3 as torch."""
    x = wide_range_activations(m, k, dtype, seed=m)
    got_q, got_s = fp8_gemm.quantize_activations(x)
    want_q, want_s = fp8.quantize_activation_groups(x, 128)
    assert same_bits(got_q, want_q)
    assert torch.equal(got_s, want_s)


@interpreter
def test_quantization_rounds_ties_to_even_and_carries_into_the_next_binade(kernels_on_cpu):
    """Every positive e4m3 value, the midpoints between neighbours (ties) and points just beside them, in a group
    whose amax is 448 (scale exactly 1), both signs: where the interpreter's own cast goes wrong."""
    grid = torch.arange(1, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 2^-9 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    values = torch.cat([values, -values])
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows * 127)
    x[: values.numel()] = values
    x = torch.cat([torch.full((rows, 1), 448.0), x.view(rows, 127)], dim=1)
    got_q, got_s = fp8_gemm.quantize_activations(x)
    want_q, want_s = fp8.quantize_activation_groups(x, 128)
    assert torch.equal(got_s, torch.ones(rows, 1))
    assert same_bits(got_q, want_q)


LINEAR_CASES = {
    "even-128x128": (32, 256, 256, BlockShape(128, 128), False),
    "ragged-m-n-k-128x128": (5, 130, 300, BlockShape(128, 128), True),
    "row-scales-1x128": (7, 48, 384, BlockShape(1, 128), False),
    "per-channel-1xK": (3, 40, 200, BlockShape(1, 200), True),
    "prefill-tiles": (300, 136, 256, BlockShape(128, 128), False),
}


@interpreter
@pytest.mark.parametrize("case", LINEAR_CASES.values(), ids=LINEAR_CASES.keys())
def test_fp8_linear_kernel_matches_the_w8a8_reference(kernels_on_cpu, case):
    """To float32 accumulation order: the kernel scales each K tile's fp8 dot, the reference dequantises first."""
    m, n, k, block, with_bias = case
    gen = torch.Generator().manual_seed(m)
    weight, scale = fp8.quantize_weight_blocks(torch.randn(n, k, generator=gen), block)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = fp8_gemm.fp8_linear(x, weight, scale, block, bias)
    want = fp8.block_fp8_linear_reference(x, weight, scale, block, bias)  # per token against per-channel weights
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@interpreter
def test_fp8_linear_of_no_tokens_is_empty(kernels_on_cpu):
    weight, scale = fp8.quantize_weight_blocks(torch.randn(64, 128), BlockShape(128, 128))
    out = fp8_gemm.fp8_linear(torch.empty(0, 128), weight, scale, BlockShape(128, 128))
    assert out.shape == (0, 64)


def test_activations_are_quantised_per_token_against_per_channel_weights_and_per_128_columns_against_blocks():
    x = wide_range_activations(4, 256, torch.float32, seed=0)
    for block, group in ((BlockShape(1, 256), 256), (BlockShape(1, 1 << 30), 256), (BlockShape(128, 128), 128),
                         (BlockShape(1, 128), 128)):
        assert fp8.activation_group(block, 256) == group
        weight, scale = fp8.quantize_weight_blocks(torch.randn(32, 256), block)
        want = fp8.block_fp8_linear_reference(x, weight, scale, block, act_group=group)
        assert torch.equal(fp8_gemm.fp8_linear(x, weight, scale, block, backend="scaled_mm"), want)  # off CUDA: the reference
        assert torch.equal(fp8.block_fp8_linear_reference(x, weight, scale, block), want)
        other = 128 if group == 256 else 256
        assert not torch.equal(fp8.block_fp8_linear_reference(x, weight, scale, block, act_group=other), want)


@interpreter
def test_per_token_quantisation_kernel_is_bit_equal_to_the_reference(kernels_on_cpu):
    for k in (200, 768, 2048):
        x = wide_range_activations(5, k, torch.float32, seed=k)
        got_q, got_s = fp8_gemm.quantize_tokens(x)
        want_q, want_s = fp8.quantize_activation_groups(x, k)
        assert got_s.shape == (5, 1) and torch.equal(got_s, want_s) and same_bits(got_q, want_q)


@interpreter
@pytest.mark.parametrize("inter", [96, 88, 64], ids=["64+32", "64+24-of-32", "one-piece"])
def test_silu_mul_quantise_kernel_is_bit_equal_to_the_reference(kernels_on_cpu, inter):
    """The kernel takes a row in two power-of-two pieces (grouped_fp8_moe.row_pieces): exactly, one masked, or one."""
    from workers.model import grouped_fp8_moe

    h = torch.randn(19, 2 * inter, generator=torch.Generator().manual_seed(3)) * 4
    h[2] = 0.0  # an all-zero row: the amax floor
    got_q, got_s = grouped_fp8_moe.silu_mul_quantize(h, torch.float32)
    want_q, want_s = grouped_fp8_moe.silu_mul_quantize_reference(h, torch.float32)
    assert got_s.shape == (19,)
    torch.testing.assert_close(got_s, want_s, rtol=2e-7, atol=0)  # exp: the interpreter's libm and torch's may differ by an ulp
    assert (got_q.float() - want_q.float()).abs().max() <= 2.0**-3 * want_q.float().abs().max()
    assert (got_q.float() != want_q.float()).float().mean() < 0.02


@interpreter
def test_combine_kernel_sums_each_tokens_weighted_rows_and_drops_foreign_pairs(kernels_on_cpu):
    from workers.model import grouped_fp8_moe

    gen = torch.Generator().manual_seed(4)
    tokens, k, experts, hidden = 6, 3, 5, 40
    top_i = torch.randint(0, experts + 1, (tokens, k), generator=gen)  # experts: another rank's pair
    top_w = torch.rand(tokens, k, generator=gen)
    ys = torch.randn(tokens * k, hidden, generator=gen)
    pos = torch.randperm(tokens * k, generator=gen)
    got = grouped_fp8_moe.combine(ys, pos, top_w, top_i, experts)
    want = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(k):
            if top_i[t, j] < experts:
                want[t] += top_w[t, j] * ys[pos[t * k + j]]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped_fp8_moe.combine_reference(ys, pos, top_w, top_i, experts), want, rtol=1e-6, atol=1e-6)


def test_fp8_linear_names_a_scale_that_does_not_fit_and_an_unknown_backend():
    weight, scale = fp8.quantize_weight_blocks(torch.randn(256, 256), BlockShape(128, 128))
    with pytest.raises(ValueError, match=r"weight scale .*\(2, 2\).*blocks of 1x128"):
        fp8_gemm.fp8_linear(torch.randn(2, 256), weight, scale, BlockShape(1, 128))
    with pytest.raises(ValueError, match="backend 'cutlass'"):
        fp8_gemm.fp8_linear(torch.randn(2, 256), weight, scale, BlockShape(128, 128), backend="cutlass")
    with pytest.raises(ValueError, match="block.k must be a multiple of 128"):
        w, s = fp8.quantize_weight_blocks(torch.randn(64, 256), BlockShape(1, 64))
        fp8_gemm.fp8_linear(torch.randn(2, 256), w, s, BlockShape(1, 64))


@pytest.mark.parametrize("block", [BlockShape(128, 128), BlockShape(1, 128), BlockShape(1, 384)],
                         ids=["128x128", "1x128", "per-channel"])
def test_scaled_mm_blockwise_passes_torchs_own_layout_checks(block):
    """torch's meta kernel for scaled_mm checks blockwise scale shapes and strides (and rejects others); meta
    tensors run those checks without a GPU. M = 24: not a multiple of anything; K/128 = 3 pads to L4 = 4."""
    if not hasattr(F, "scaled_mm"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    m, n, k = 24, 256, 384
    xq = torch.empty(m, k, dtype=FP8_DTYPE, device="meta")
    xs = torch.empty(m, k // 128, device="meta")
    weight = torch.empty(n, k, dtype=FP8_DTYPE, device="meta")
    out = fp8_gemm.scaled_mm_blockwise(xq, xs, weight, torch.empty(*block.grid(n, k), device="meta"), torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="blockwise"):  # the same scales without the stride change
        F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, torch.empty(n // 128, k // 128, device="meta"),
                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def test_scaled_mm_is_used_only_for_the_shapes_its_recipes_describe():
    assert fp8_gemm.scaled_mm_fits(5120, 2048, BlockShape(128, 128), torch.bfloat16)
    assert fp8_gemm.scaled_mm_fits(5120, 2048, BlockShape(1, 2048), torch.bfloat16)
    assert not fp8_gemm.scaled_mm_fits(5120 + 64, 2048, BlockShape(1, 128), torch.bfloat16)  # N % 128
    assert not fp8_gemm.scaled_mm_fits(5120, 2048, BlockShape(128, 128), torch.float16)
    assert not fp8_gemm.scaled_mm_fits(5120, 2048, BlockShape(64, 128), torch.bfloat16)
    assert not fp8_gemm.scaled_mm_fits(5120, 2048, BlockShape(128, 128), torch.bfloat16, m=2)  # cuBLAS: M % 4


# --- the fused MoE on fp8 experts ---


def fp8_experts(num_experts: int, hidden: int, inter: int, block: BlockShape, seed: int):
    gen = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = fp8.quantize_weight_blocks(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1, block)
    down, down_scale = fp8.quantize_weight_blocks(torch.randn(num_experts, hidden, inter, generator=gen) * 0.1, block)
    return gate_up, down, fused_moe.ExpertScales(gate_up_scale, down_scale, block)


def fp8_experts_reference(x, top_w, top_i, gate_up, down, scales: fused_moe.ExpertScales, w8a8: bool) -> torch.Tensor:
    """Pair by pair, rounded to x's dtype where the kernels round. w8a8: x and the gated output quantised per
    token and group of 128 (block_fp8_linear_reference); else W8A16: the dequantised weights times x as it is."""
    dtype, num_experts = x.dtype, gate_up.shape[0]

    def linear(a, weight, scale):
        if w8a8:
            return fp8.block_fp8_linear_reference(a, weight, scale, scales.block)
        return (a.float() @ fp8.dequantize_weight_blocks(weight, scale, scales.block).t()).to(dtype)

    out = torch.zeros(x.shape[0], down.shape[1])
    for t, j in torch.cartesian_prod(torch.arange(top_i.shape[0]), torch.arange(top_i.shape[1])).tolist():
        e = int(top_i[t, j])
        if e >= num_experts:  # another rank's expert
            continue
        gate, up = linear(x[t : t + 1], gate_up[e], scales.gate_up[e]).float().chunk(2, dim=-1)
        act = (F.silu(gate).to(dtype).float() * up).to(dtype)
        y = linear(act, down[e], scales.down[e])
        out[t] += (y.float() * top_w[t, j]).to(dtype).float()[0]
    return out.to(dtype)


def routed(tokens: int, bins: int, k: int, hidden: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    top_i = torch.stack([torch.randperm(bins, generator=gen)[:k] for _ in range(tokens)])
    return torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, k, generator=gen), top_i


MOE_CASES = {  # tokens, hidden, inter, block.n, foreign
    "even-128-blocks": (3, 256, 128, 128, False),
    "ragged-h-and-i-row-scales": (2, 200, 160, 1, False),
    "foreign-pairs": (4, 256, 128, 128, True),
}


@interpreter
@pytest.mark.parametrize("case", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_fp8_small_batch_kernels_match_the_w8a16_reference(case):
    tokens, hidden, inter, bn, foreign = case
    gate_up, down, scales = fp8_experts(4, hidden, inter, BlockShape(bn, 128), seed=tokens)
    x, top_w, top_i = routed(tokens, 4 + foreign, 2, hidden, seed=tokens)
    got = fused_moe.small_batch_experts(x, top_w, top_i, gate_up, down, scales)
    want = fp8_experts_reference(x, top_w, top_i, gate_up, down, scales, w8a8=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def assert_close_but_for_e4m3_flips(got: torch.Tensor, want: torch.Tensor) -> None:
    """The tiled kernels round their intermediate rows to e4m3, and so does the reference, from float32 sums in
    another order: an intermediate that lands on a rounding midpoint can round to the other neighbour (one e4m3 step,
    2^-3 of it), which moves every output of its token by a few percent (seen on the interpreter on one machine and
    not another: the host's BLAS orders the sums). Every token's row matches to float32 rounding but for at most one in
    ten rows, and those within 5%; a wrong index or scale is off by order 1."""
    tol = 1e-5 * want.abs().max().item()
    close = ((got - want).abs() <= tol + 1e-5 * want.abs()).all(dim=1)
    assert close.float().mean().item() >= 0.9, f"{int((~close).sum())} of {len(close)} rows differ"
    row_error = (got - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-12)
    assert row_error.max().item() < 0.05, row_error.max().item()


@interpreter
@pytest.mark.parametrize("case", MOE_CASES.values(), ids=MOE_CASES.keys())
def test_fp8_tiled_kernels_match_the_w8a8_reference(case):
    """20+ tokens: the gated GEMM quantises its output rows in its epilogue, the down GEMM reads them."""
    tokens, hidden, inter, bn, foreign = case
    gate_up, down, scales = fp8_experts(4, hidden, inter, BlockShape(bn, 128), seed=tokens)
    x, top_w, top_i = routed(20 + tokens, 4 + foreign, 2, hidden, seed=tokens)
    got = fused_moe.tiled_experts(x, top_w, top_i, gate_up, down, foreign, scales)
    want = fp8_experts_reference(x, top_w, top_i, gate_up, down, scales, w8a8=True)
    assert_close_but_for_e4m3_flips(got, want)


@interpreter
@pytest.mark.parametrize("tma", [0, 1], ids=["pointer-loads", "tma-weight-tiles"])
def test_fp8_tiled_kernels_on_two_row_blocks_and_column_tiles_match_the_reference(monkeypatch, tma):
    """BLOCK_M 16 with 40 pairs over 2 experts (several row blocks each), inter 160: the gated GEMM's second
    column tile runs past N (into the up rows through TMA), the down GEMM's second K tile past K."""
    monkeypatch.setattr(fused_moe, "tile_config", lambda *args: fused_moe.TileConfig(16, 128, 128, 4, 1, 1, tma=tma))
    gate_up, down, scales = fp8_experts(2, 256, 160, BlockShape(1, 128), seed=7)
    x, top_w, top_i = routed(20, 2, 2, 256, seed=7)
    got = fused_moe.tiled_experts(x, top_w, top_i, gate_up, down, False, scales)
    want = fp8_experts_reference(x, top_w, top_i, gate_up, down, scales, w8a8=True)
    assert_close_but_for_e4m3_flips(got, want)


@interpreter
def test_fused_experts_takes_the_fp8_path_when_scales_are_given():
    gate_up, down, scales = fp8_experts(4, 256, 128, BlockShape(128, 128), seed=3)
    x, top_w, top_i = routed(2, 4, 2, 256, seed=3)
    got = fused_moe.fused_experts(x, top_w, top_i, gate_up, down, gate_up_scale=scales.gate_up,
                                  down_scale=scales.down, block=scales.block)
    torch.testing.assert_close(got, fp8_experts_reference(x, top_w, top_i, gate_up, down, scales, w8a8=False))


def test_fused_experts_names_the_fp8_operand_that_does_not_fit():
    gate_up, down, scales = fp8_experts(4, 256, 128, BlockShape(128, 128), seed=0)
    x, top_w, top_i = routed(2, 4, 2, 256, seed=0)
    with pytest.raises(ValueError, match="together"):
        fused_moe.fused_experts(x, top_w, top_i, gate_up, down, gate_up_scale=scales.gate_up)
    with pytest.raises(ValueError, match=r"down_proj scale .*\(4, 1, 1\).*needs float32 \(4, 2, 1\)"):
        fused_moe.fused_experts(x, top_w, top_i, gate_up, down, gate_up_scale=scales.gate_up,
                                down_scale=scales.down[:, :1], block=scales.block)
    with pytest.raises(ValueError, match="block.k == 128"):
        fused_moe.fused_experts(x, top_w, top_i, gate_up, down, gate_up_scale=scales.gate_up, down_scale=scales.down,
                                block=BlockShape(128, 256))
    with pytest.raises(ValueError, match="gate_up_proj is torch.float32"):
        fused_moe.fused_experts(x, top_w, top_i, gate_up.float(), down, gate_up_scale=scales.gate_up,
                                down_scale=scales.down, block=scales.block)


def test_fp8_experts_have_their_own_tile_rows_with_k_tiles_of_one_scale_block(monkeypatch, tmp_path):
    bf16_key, fp8_key = fused_moe.shape_key(8, 32, 256, True), fused_moe.shape_key(8, 32, 256, True, fp8=True)
    assert fp8_key == bf16_key + ",fp8"
    (tmp_path / "Some_GPU.json").write_text(
        f'{{"{bf16_key}": [[64, [16, 64, 64, 4, 5]]], "{fp8_key}": [[64, [16, 128, 128, 4, 3]], [512, [16, 64, 128, 4, 3]]]}}')
    monkeypatch.setattr(fused_moe, "TUNED_DIR", tmp_path)
    fused_moe._tuned.cache_clear()
    try:
        assert fused_moe.tile_config(10, True, fp8_key, "Some GPU", fp8=True) == fused_moe.TileConfig(16, 128, 128, 4, 3)
        with pytest.raises(ValueError, match="BLOCK_N 128 when gated"):
            fused_moe.tile_config(100, True, fp8_key, "Some GPU", fp8=True)
    finally:
        fused_moe._tuned.cache_clear()
    for pairs in (8, 64, 65, 4096, 4097, 16384, 10**6):
        for gated in (True, False):
            cfg = fused_moe.tile_config(pairs, gated, fp8=True)
            assert cfg.block_k == 128 and (cfg.block_n == 128 or not gated)


def test_fp8_warm_up_steps_take_every_fp8_tile_config_pair():
    gate_up = torch.empty(128, 2 * 768, 2048, dtype=FP8_DTYPE, device="meta")
    keys = fused_moe.shape_key(128, 768, 2048, True, True), fused_moe.shape_key(128, 2048, 768, False, True)

    def configs(tokens):
        return tuple(fused_moe.tile_config(tokens * 8, g, key, "NVIDIA H200", True) for g, key in zip((True, False), keys))

    tokens = fused_moe.warm_up_tokens(gate_up, 8, 8192, "NVIDIA H200")
    assert {configs(t) for t in tokens} == {configs(t) for t in range(fused_moe.SMALL_BATCH_TOKENS + 1, 8193)}
