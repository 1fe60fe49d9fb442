"""The FP8 kernels on the GPU at the real layer shapes (30B-A3B: hidden 2048, q/k/v 4096+512+512, 128 experts of
768, top-8; 235B-A22B: hidden 4096, experts of 1536), against the W8A8 reference tightly and against the
dequantised-weights reference (activations not quantised) within e4m3's rounding.

Error bounds. Both sides quantise the same way (quantize_activations is bit-equal to the reference), e4m3 x e4m3
products are exact in float32, so against the W8A8 reference only float32 accumulation order (<= 2^-14 of
sum |a w| at these K) and the bf16 output rounding (one ulp, 2^-8 relative, either side) remain. Against the
dequantised reference the activations' e4m3 rounding enters: at most 2^-4 of each element (3 mantissa bits; below
the normal range 2^-10 of its group's scale), so |err| <= 2^-4 * sum |x w| (+ that subnormal term) element by element; for random data the errors are independent and the relative
Frobenius error is about 0.026 per quantised operand (mantissa spacing 2^-3 / sqrt(12), over log-uniform
mantissas), so 0.05 for one quantised operand (a linear) and 0.07 for two (the MoE's x and its gated output).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from workers.model import fp8, fp8_gemm, fused_moe, grouped_fp8_moe
from workers.checkpoint_quant import BlockShape

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ULP_BF16 = 2.0**-8
E4M3_HALF_STEP = 2.0**-4


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """The references' float32 matmuls in full float32 (TF32 would be a 2^-11 reference error)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def quantized_weight(n: int, k: int, block: BlockShape, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return fp8.quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=gen) * 0.05, block)


DENSE_SHAPES = {  # (N, K): 30B-A3B's fused q/k/v and o projections, 235B-A22B's o projection
    "30b-qkv": (5120, 2048),
    "30b-o": (2048, 4096),
    "235b-o": (4096, 8192),
}
BLOCKS = {"128x128": BlockShape(128, 128), "1x128": BlockShape(1, 128), "per-channel": None}


@pytest.mark.parametrize("m", [1, 8, 64, 256, 1024, 8192])
@pytest.mark.parametrize("k", [2048, 4096, 300])
def test_activation_quantization_is_bit_equal_to_the_reference_on_the_gpu(m, k):
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 2, k, device="cuda")).bfloat16()
    got_q, got_s = fp8_gemm.quantize_activations(x)
    # The reference on the CPU: CUDA torch divides by a Python scalar as a multiplication by its reciprocal (the
    # H200 run differed there by an ulp of the scale), the CPU with IEEE division, as the kernel does.
    want_q, want_s = fp8.quantize_activation_groups(x.cpu(), 128)
    assert torch.equal(got_q.view(torch.uint8).cpu(), want_q.view(torch.uint8))
    assert torch.equal(got_s.cpu(), want_s)


@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
@pytest.mark.parametrize("block_name", BLOCKS)
@pytest.mark.parametrize("m", [1, 7, 64, 300, 4096])
def test_fp8_linear_matches_the_w8a8_reference_and_the_dequantized_one_within_e4m3_rounding(shape, block_name, m):
    n, k = shape
    block = BLOCKS[block_name] or BlockShape(1, k)
    weight, scale = quantized_weight(n, k, block, seed=m)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    got = fp8_gemm.fp8_linear(x, weight, scale, block, bias, backend="triton").float()
    w = fp8.dequantize_weight_blocks(weight, scale, block)
    magnitude = x.float().abs() @ w.abs().t()
    want = fp8.block_fp8_linear_reference(x, weight, scale, block, bias).float()  # per token on per-channel weights
    assert ((got - want).abs() <= 2 * ULP_BF16 * want.abs() + 2.0**-14 * magnitude).all()
    dequantized = F.linear(x.float(), w, bias.float())
    # an element below e4m3's normal range (|x / scale| < 2^-6) is off by up to half its spacing, 2^-10 * scale
    group = fp8.activation_group(block, k)
    _, x_scale = fp8.quantize_activation_groups(x, group)
    subnormal = 2.0**-10 * x_scale.repeat_interleave(group, dim=1)[:, :k] @ w.abs().t()
    assert ((got - dequantized).abs() <= E4M3_HALF_STEP * magnitude + subnormal + ULP_BF16 * dequantized.abs()).all()
    assert rel(got, dequantized) < 0.05


@pytest.mark.parametrize("block", [BlockShape(128, 128), BlockShape(1, 128)], ids=["128x128", "1x128"])
@pytest.mark.parametrize("m", [1, 24, 1024])  # 1: outside the recipe's M (the Triton GEMM answers)
def test_scaled_mm_blockwise_matches_the_w8a8_reference_where_torch_has_it(block, m):
    if not fp8_gemm.scaled_mm_available(torch.device("cuda")):
        pytest.skip("torch._scaled_mm has no blockwise fp8 on this torch/GPU (the probe failed)")
    n, k = DENSE_SHAPES["30b-qkv"]
    weight, scale = quantized_weight(n, k, block, seed=m)
    x = torch.randn(m, k, device="cuda").bfloat16()
    got = fp8_gemm.fp8_linear(x, weight, scale, block, backend="scaled_mm").float()
    want = fp8.block_fp8_linear_reference(x, weight, scale, block, act_group=128).float()
    magnitude = x.float().abs() @ fp8.dequantize_weight_blocks(weight, scale, block).abs().t()
    assert ((got - want).abs() <= 2 * ULP_BF16 * want.abs() + 2.0**-14 * magnitude).all()


def test_torchs_fp8_gemms_pass_their_probes_on_this_gpu():
    """torch 2.11 on the H200 has both recipes (benchmarks/README.md, eleventh pass); a failure names its reason."""
    device = torch.device("cuda")
    assert fp8_gemm.scaled_mm_available(device), fp8_gemm.PROBE_FAILURES
    assert fp8_gemm.rowwise_available(device), fp8_gemm.PROBE_FAILURES


@pytest.mark.parametrize("shape", DENSE_SHAPES.values(), ids=DENSE_SHAPES.keys())
@pytest.mark.parametrize("m", [1, 7, 64, 300, 4096])
def test_per_channel_fp8_linear_through_the_row_wise_gemm_matches_the_per_token_reference(shape, m):
    """Both sides quantise x per token bit for bit; float32 accumulation order and the bf16 output rounding remain."""
    n, k = shape
    if not fp8_gemm.rowwise_fits(n, k, torch.bfloat16):
        pytest.skip("shape outside the row-wise recipe")
    block = BlockShape(1, k)
    weight, scale = quantized_weight(n, k, block, seed=m)
    x = torch.randn(m, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    got = fp8_gemm.fp8_linear(x, weight, scale, block, bias).float()
    want = fp8.block_fp8_linear_reference(x, weight, scale, block, bias).float()
    magnitude = x.float().abs() @ fp8.dequantize_weight_blocks(weight, scale, block).abs().t()
    err = (got - want).abs() - 2 * ULP_BF16 * want.abs()
    assert (err <= 2.0**-14 * magnitude).all(), f"worst {(err / magnitude).max().item():.3g} of sum |x w|"


def capture(fn):
    """fn() captured in a CUDA graph after an eager warm-up on a side stream: (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("m", [1, 64, 1024])
def test_fp8_linear_replays_in_a_cuda_graph(m):
    weight, scale = quantized_weight(5120, 2048, BlockShape(128, 128), seed=0)
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    graph, out = capture(lambda: fp8_gemm.fp8_linear(x, weight, scale, BlockShape(128, 128)))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_gemm.fp8_linear(x, weight, scale, BlockShape(128, 128)))


# --- the fused MoE ---

MOE_SHAPES = {"30b": (128, 2048, 768), "235b": (128, 4096, 1536)}


def fp8_experts(num_experts: int, hidden: int, inter: int, block: BlockShape, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.05
    down = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.05
    (gu, gus), (dn, dns) = fp8.quantize_weight_blocks(gate_up, block), fp8.quantize_weight_blocks(down, block)
    return gu, dn, fused_moe.ExpertScales(gus, dns, block)


def routed(tokens: int, num_experts: int, hidden: int, seed: int, bins: int | None = None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top_i = torch.rand(tokens, bins or num_experts, device="cuda", generator=gen).topk(8, dim=-1).indices
    top_w = torch.rand(tokens, 8, device="cuda", generator=gen).softmax(dim=-1).bfloat16()
    return torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16(), top_w, top_i.clamp(max=num_experts)


def moe_reference(x, top_w, top_i, gate_up, down, scales: fused_moe.ExpertScales, quantize: bool,
                  per_token: bool = False) -> torch.Tensor:
    """float64 over the dequantised experts, expert by expert; quantize: x and the gated output pass through the
    e4m3 quantisation the W8A8 path applies (per token and group of 128; per_token: per token, the FP8-dynamic
    format's), with the kernels' bf16 roundings before it (gate and up; then silu(gate) for the Triton kernel, whose
    product is rounded again, or the product alone for the grouped path's silu-mul-quantise): a bf16 difference moves
    an element across an e4m3 rounding boundary (2^-8 against steps of 2^-3), which alone made a 1.6% relative
    difference on the H200 (run41) without these roundings."""

    def activations(a):
        if not quantize:
            return a.double()
        group = a.shape[1] if per_token else 128
        q, s = fp8.quantize_activation_groups(a, group)
        return q.double() * s.double().repeat_interleave(group, dim=1)[:, : a.shape[1]]

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in top_i.unique().tolist():
        if e >= gate_up.shape[0]:
            continue
        token, slot = (top_i == e).nonzero(as_tuple=True)
        w1 = fp8.dequantize_weight_blocks(gate_up[e], scales.gate_up[e], scales.block, torch.float64)
        w2 = fp8.dequantize_weight_blocks(down[e], scales.down[e], scales.block, torch.float64)
        gate, up = (activations(x[token]) @ w1.T).chunk(2, dim=-1)
        if quantize:
            gate, up = gate.bfloat16().double(), up.bfloat16().double()
            silu = F.silu(gate) if per_token else F.silu(gate).bfloat16().double()
            act = (silu * up).bfloat16()
        else:
            act = F.silu(gate) * up
        y = activations(act) @ w2.T
        out.index_add_(0, token, y * top_w[token, slot].double().unsqueeze(-1))
    return out


@pytest.mark.parametrize("shape", MOE_SHAPES.values(), ids=MOE_SHAPES.keys())
@pytest.mark.parametrize("bn", [128, 1])
@pytest.mark.parametrize("tokens", [1, 8, 64, 300, 4096])
def test_fp8_fused_moe_matches_its_references(shape, bn, tokens):
    """<= 8 tokens: the W8A16 GEMV path, tight against the dequantised weights (bf16 roundings only); above: the
    W8A8 tiles, tight against the quantised reference and within e4m3's rounding of the dequantised one."""
    num_experts, hidden, inter = shape
    gate_up, down, scales = fp8_experts(num_experts, hidden, inter, BlockShape(bn, 128), seed=tokens)
    x, top_w, top_i = routed(tokens, num_experts, hidden, seed=tokens)
    got = fused_moe.fused_experts(x, top_w, top_i, gate_up, down, gate_up_scale=scales.gate_up,
                                  down_scale=scales.down, block=scales.block)
    dequantized = moe_reference(x, top_w, top_i, gate_up, down, scales, quantize=False)
    if tokens <= fused_moe.SMALL_BATCH_TOKENS:
        assert rel(got, dequantized) < 1e-2
    else:
        assert rel(got, moe_reference(x, top_w, top_i, gate_up, down, scales, quantize=True)) < 1e-2
        assert rel(got, dequantized) < 0.07


@pytest.mark.parametrize("tokens", [1, 300])
def test_fp8_fused_moe_pairs_of_another_ranks_experts_add_zero(tokens):
    """Expert parallelism over two ranks at the 30B shape: experts 0-63 here, pairs of 64-127 get id 64."""
    gate_up, down, scales = fp8_experts(64, 2048, 768, BlockShape(128, 128), seed=tokens)
    x, top_w, top_i = routed(tokens, 64, 2048, seed=tokens, bins=128)
    got = fused_moe.fused_experts(x, top_w, top_i, gate_up, down, foreign=True, gate_up_scale=scales.gate_up,
                                  down_scale=scales.down, block=scales.block)
    quantize = tokens > fused_moe.SMALL_BATCH_TOKENS
    assert rel(got, moe_reference(x, top_w, top_i, gate_up, down, scales, quantize)) < 1e-2


@pytest.mark.parametrize("tokens", [300, 8192])
def test_fp8_tma_weight_tiles_give_the_pointer_loads_numbers(monkeypatch, tokens):
    gate_up, down, scales = fp8_experts(128, 2048, 768, BlockShape(128, 128), seed=tokens)
    x, top_w, top_i = routed(tokens, 128, 2048, seed=tokens)
    heuristic, outs = fused_moe.tile_config, {}
    for tma in (0, 1):
        monkeypatch.setattr(fused_moe, "tile_config", lambda *args, tma=tma: dataclasses.replace(heuristic(*args), tma=tma))
        outs[tma] = fused_moe.tiled_experts(x, top_w, top_i, gate_up, down, False, scales)
    assert torch.equal(outs[1], outs[0])


def assert_replay_follows_new_routing(run, x, top_w, top_i, tokens: int) -> None:
    """run() captured in a CUDA graph, its inputs (30B shape: 128 experts, hidden 2048) refilled with another routing,
    the graph replayed: the output equals an eager run on the new inputs."""
    with torch.inference_mode():
        graph, out = capture(run)
        fresh_x, fresh_w, fresh_i = routed(tokens, 128, 2048, seed=tokens + 1)
        x.copy_(fresh_x), top_w.copy_(fresh_w), top_i.copy_(fresh_i)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_fp8_fused_moe_replays_in_a_cuda_graph(tokens):
    gate_up, down, scales = fp8_experts(128, 2048, 768, BlockShape(128, 128), seed=tokens)
    x, top_w, top_i = routed(tokens, 128, 2048, seed=tokens)

    def run():
        return fused_moe.fused_experts(x, top_w, top_i, gate_up, down, gate_up_scale=scales.gate_up,
                                       down_scale=scales.down, block=scales.block)

    assert_replay_follows_new_routing(run, x, top_w, top_i, tokens)


# --- per-channel FP8 experts: torch's grouped GEMM ---


# the grouped MoE against its per-token reference: fast accumulation (grouped_fp8_moe.FAST_ACCUM) moves some bf16 gated
# outputs across e4m3 boundaries, 2%; 1% with float32 accumulation
GROUPED_BOUND = 2e-2 if grouped_fp8_moe.FAST_ACCUM else 1e-2


def channel_experts(num_experts: int, hidden: int, inter: int, seed: int):
    return fp8_experts(num_experts, hidden, inter, BlockShape(1, 1 << 30), seed)


def channel_moe_reference(x, top_w, top_i, gate_up, down, scales) -> torch.Tensor:
    """The grouped path's numbers: moe_reference with per-token quantisation."""
    return moe_reference(x, top_w, top_i, gate_up, down, scales, quantize=True, per_token=True)


@pytest.mark.parametrize("shape", MOE_SHAPES.values(), ids=MOE_SHAPES.keys())
@pytest.mark.parametrize("tokens", [9, 64, 300, 4096])
def test_grouped_fp8_experts_match_the_per_token_reference(shape, tokens):
    if not grouped_fp8_moe.available(torch.device("cuda")):
        pytest.fail(f"torch._scaled_grouped_mm failed its probe: {fp8_gemm.PROBE_FAILURES}")
    num_experts, hidden, inter = shape
    gate_up, down, scales = channel_experts(num_experts, hidden, inter, seed=tokens)
    x, top_w, top_i = routed(tokens, num_experts, hidden, seed=tokens)
    got = grouped_fp8_moe.grouped_fp8_experts(x, top_w, top_i, gate_up, down, scales.gate_up, scales.down)
    err = rel(got, channel_moe_reference(x, top_w, top_i, gate_up, down, scales))
    assert err < GROUPED_BOUND, err
    assert rel(got, moe_reference(x, top_w, top_i, gate_up, down, scales, quantize=False)) < 0.07


def test_grouped_fp8_experts_pairs_of_another_ranks_experts_add_zero():
    gate_up, down, scales = channel_experts(64, 2048, 768, seed=5)
    x, top_w, top_i = routed(300, 64, 2048, seed=5, bins=128)
    got = grouped_fp8_moe.grouped_fp8_experts(x, top_w, top_i, gate_up, down, scales.gate_up, scales.down, foreign=True)
    assert rel(got, channel_moe_reference(x, top_w, top_i, gate_up, down, scales)) < GROUPED_BOUND


@pytest.mark.parametrize("tokens", [1, 8, 9, 300, 4096])
def test_per_channel_moe_experts_module_takes_each_path_within_its_bound(tokens):
    """MoeExperts on per-channel FP8: the GEMV kernels (<= 8 tokens, W8A16), the tiled Triton ones (activations
    in groups of 128, finer than per token: within the per-token reference's own rounding of the exact one) or, from
    GROUPED_FP8_MIN_TOKENS, torch's grouped GEMM."""
    from workers.model.moe import GROUPED_FP8_MIN_TOKENS

    from workers.model.moe import MoeExperts

    gate_up, down, scales = channel_experts(128, 2048, 768, seed=tokens)
    with torch.device("meta"):
        experts = MoeExperts(128, 2048, 768, BlockShape(1, 1 << 30))
    experts.gate_up_proj, experts.down_proj = torch.nn.Parameter(gate_up, False), torch.nn.Parameter(down, False)
    experts.gate_up_scale, experts.down_scale = torch.nn.Parameter(scales.gate_up, False), torch.nn.Parameter(scales.down, False)
    x, top_w, top_i = routed(tokens, 128, 2048, seed=tokens)
    got = experts(x, top_w, top_i)
    if tokens <= fused_moe.SMALL_BATCH_TOKENS:
        assert rel(got, moe_reference(x, top_w, top_i, gate_up, down, scales, quantize=False)) < 1e-2
    elif tokens < GROUPED_FP8_MIN_TOKENS:
        assert rel(got, moe_reference(x, top_w, top_i, gate_up, down, scales, quantize=True)) < 1e-2
    else:
        assert rel(got, channel_moe_reference(x, top_w, top_i, gate_up, down, scales)) < GROUPED_BOUND


@pytest.mark.parametrize("tokens", [9, 300])
def test_grouped_fp8_experts_replay_in_a_cuda_graph(tokens):
    gate_up, down, scales = channel_experts(128, 2048, 768, seed=tokens)
    x, top_w, top_i = routed(tokens, 128, 2048, seed=tokens)
    assert grouped_fp8_moe.available(x.device)

    def run():
        return grouped_fp8_moe.grouped_fp8_experts(x, top_w, top_i, gate_up, down, scales.gate_up, scales.down)

    assert_replay_follows_new_routing(run, x, top_w, top_i, tokens)


@pytest.mark.parametrize("k", [768, 1536, 2048, 4096])
def test_per_token_quantisation_and_silu_mul_quantise_are_bit_equal_to_their_references_on_the_gpu(k):
    x = (torch.randn(300, k, device="cuda") * torch.logspace(-3, 2, k, device="cuda")).bfloat16()
    got_q, got_s = fp8_gemm.quantize_tokens(x)
    want_q, want_s = fp8.quantize_activation_groups(x.cpu(), k)
    assert torch.equal(got_q.view(torch.uint8).cpu(), want_q.view(torch.uint8)) and torch.equal(got_s.cpu(), want_s)
    h = (torch.randn(300, 2 * k, device="cuda") * 3).bfloat16()
    got_q, got_s = grouped_fp8_moe.silu_mul_quantize(h, torch.bfloat16)
    want_q, want_s = grouped_fp8_moe.silu_mul_quantize_reference(h.cpu(), torch.bfloat16)
    # exp on the GPU and the CPU may differ by an ulp, which bf16 rounding of the product mostly absorbs
    assert (got_q.view(torch.uint8).cpu() != want_q.view(torch.uint8)).float().mean() < 1e-3
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=2**-7, atol=0)
