"""The kernels that take launches out of a text layer give what the launches they replace give: residual add +
RMSNorm + FP8 quantisation writes bit for bit what the add-and-norm kernel then the quantisation kernel write, and
the router's top-k with the alignment of its pairs writes what the route, align-count and align-scatter kernels
write; each also against its torch reference (Triton's interpreter on CPU with TRITON_INTERPRET=1, float32 and
float16 there since it casts to bfloat16 by truncation; the 30B-A3B shapes in bfloat16 on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from workers.model import fp8_gemm, fused_norm_rope, moe_routing, norm_quant, route_align
from workers.model.norm_quant import Fp8Input

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and norm_quant.triton is not None
interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
EPS = 1e-6

NORM_CASES = [pytest.param("cpu", dtype, t, n, g, marks=interpreter) for dtype in (torch.float32, torch.float16)
              for t, n, g in ((3, 200, 128), (2, 200, 256), (4, 96, 32))]
NORM_CASES += [pytest.param("cuda", torch.bfloat16, t, 2048, g, marks=gpu) for t in (1, 64, 8192) for g in (128, 2048)]


@pytest.fixture(autouse=True)
def fused_launches_on(monkeypatch):
    """The fused launches on, as bench_engine --layer-fusions on sets them (the product keeps them off until the
    H200 has run these tests); a test that compares against the separate launches turns them off itself."""
    monkeypatch.setattr(norm_quant, "FUSED", True)
    monkeypatch.setattr(route_align, "FUSED", True)


@pytest.fixture
def quantize_on_any_device(monkeypatch):
    """fp8_gemm's quantisation kernel on CPU tensors too (the interpreter runs it)."""
    monkeypatch.setattr(fp8_gemm, "on_triton", lambda t: True)


def rows(device: str, dtype: torch.dtype, t: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, n, device=device, generator=gen) * torch.logspace(-2, 1, n, device=device)
    residual = torch.randn(t, n, device=device, generator=gen)
    weight = 1 + 0.1 * torch.randn(n, device=device, generator=gen)
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rows_written_alike(got: torch.Tensor, want: torch.Tensor, device: str) -> torch.Tensor:
    """Asserts the fused kernel's normed rows are the norm kernel's and returns which rows are equal bit for bit.
    On the interpreter every row is. On the H200 the two kernels may add a row's float32 squares in different orders
    (Triton lays the fused row out for its quantisation groups): that row's rstd then moves in its last bit, and some
    of its bf16 outputs by a step or two (run85: 2-5 of 16.8M values at 8,192 rows of 2,048, at most 1.06% apart;
    none at 1 or 64 rows)."""
    equal = (got == want).all(dim=1)
    if device == "cpu":
        assert equal.all()
        return equal
    assert equal.float().mean() > 0.99
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=0)  # two bf16 steps at most
    return equal


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize("device,dtype,tokens,hidden,group", NORM_CASES)
def test_norm_quant_kernel_writes_what_the_norm_kernel_then_the_quantisation_kernel_write(
        quantize_on_any_device, device, dtype, tokens, hidden, group, with_residual):
    x, residual, weight = rows(device, dtype, tokens, hidden, seed=tokens + hidden)
    res = residual if with_residual else None
    got, total = norm_quant.add_norm_quantize(x, res, weight, EPS, Fp8Input(group, rows_too=True))
    if with_residual:
        normed, want_total = fused_norm_rope.add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(total, want_total)
    else:
        normed = fused_norm_rope.rms_norm(x, weight, EPS)
        assert total is x
    want_q, want_s = fp8_gemm.quantize_activations(normed, group)
    assert got.dtype == dtype and got.group == group
    same = rows_written_alike(got.rows, normed, device)
    assert same_bits(got.q[same], want_q[same]) and torch.equal(got.scales[same], want_s[same])
    alone, _ = norm_quant.add_norm_quantize(x, res, weight, EPS, Fp8Input(group))
    assert alone.rows is None and same_bits(alone.q, got.q)  # the rows are written only when asked for


@pytest.mark.parametrize("device,dtype,tokens,hidden,group", NORM_CASES)
def test_norm_quant_kernel_matches_its_torch_reference(device, dtype, tokens, hidden, group):
    x, residual, weight = rows(device, dtype, tokens, hidden, seed=7)
    got, total = norm_quant.add_norm_quantize(x, residual, weight, EPS, Fp8Input(group, rows_too=True))
    normed, want_total, want = norm_quant.add_norm_quantize_reference(x, residual, weight, EPS, group)
    assert torch.equal(total, want_total)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.rows, normed, **tol)
    torch.testing.assert_close(got.scales, want.scales, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=0)
    # the same e4m3 values where the normed rows agree; one e4m3 step at most where a rounding boundary fell between
    dequant = got.q.float() * got.scales.repeat_interleave(group, dim=1)[:, :hidden]
    want_dequant = want.q.float() * want.scales.repeat_interleave(group, dim=1)[:, :hidden]
    step = want.scales.repeat_interleave(group, dim=1)[:, :hidden] * 32  # e4m3's spacing at its top binade
    assert ((dequant - want_dequant).abs() <= step).all()
    assert (got.q.view(torch.uint8) != want.q.view(torch.uint8)).float().mean() < 0.02


ROUTE_CASES = {  # tokens, experts, k, block_m, expert range (None: all)
    "one-token": (1, 16, 4, 4, None),
    "several-programs": (37, 16, 4, 8, None),
    "expert-parallel-rank": (23, 16, 4, 4, (4, 12)),
    "one-pair-a-block": (9, 8, 2, 1, None),
}
ROUTE_PARAMS = [pytest.param(*case, marks=interpreter, id=name) for name, case in ROUTE_CASES.items()]
ROUTE_PARAMS += [pytest.param(t, 128, 8, 16, None, marks=gpu, id=f"30b-{t}") for t in (1, 8, 256, 512)]


@pytest.mark.parametrize("tokens,experts,k,block_m,expert_range", ROUTE_PARAMS)
def test_route_align_kernel_writes_what_the_route_and_align_kernels_write(monkeypatch, tokens, experts, k, block_m,
                                                                          expert_range):
    device = "cpu" if INTERPRETER else "cuda"
    monkeypatch.setattr(moe_routing, "on_triton", lambda t: True)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(device)
    lo, hi = expert_range or (0, experts)
    bins = hi - lo + (expert_range is not None)  # a bin for other ranks' pairs
    assert route_align.supports(logits, k)
    for _ in range(2):  # the ticket counter is back at zero after each launch
        got_w, got_i, got = route_align.route_align(logits, k, lo, hi, bins, block_m)
        want_w, want_i = moe_routing.route_triton(logits, k, lo, hi)
        want_ids, want_experts = moe_routing.align_pairs_triton(want_i, bins, block_m)
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
        assert torch.equal(got.sorted_ids, want_ids) and torch.equal(got.block_expert, want_experts)
        assert got.block_m == block_m and route_align._counter(logits.device).item() == 0
    ref_w, ref_i, ref = route_align.route_align_reference(logits.cpu(), k, lo, hi, bins, block_m)
    assert torch.equal(got_i.cpu(), ref_i) and torch.equal(got.sorted_ids.cpu(), ref.sorted_ids)
    torch.testing.assert_close(got_w.cpu(), ref_w)


PAIR_CASES = {  # tokens, experts, k, foreign (a bin for other ranks' pairs)
    "one-chunk": (5, 8, 2, False),
    "several-chunks": (300, 16, 4, False),  # 1,200 pairs: chunks of 64, the last one cut
    "other-ranks-pairs": (77, 8, 4, True),
    "empty-experts": (3, 64, 2, False),
}
PAIR_PARAMS = [pytest.param(*case, marks=interpreter, id=name) for name, case in PAIR_CASES.items()]
PAIR_PARAMS += [pytest.param(t, 128, 8, f, marks=gpu, id=f"30b-{t}{'-foreign' if f else ''}")
                for t, f in ((2048, False), (8192, False), (16384, False), (8192, True))]


@pytest.mark.parametrize("tokens,experts,k,foreign", PAIR_PARAMS)
def test_pair_layout_kernels_write_what_the_sort_and_index_ops_write(tokens, experts, k, foreign):
    """The grouped GEMMs' rows of the pairs (long prompt steps): two launches give sort_pairs' stable order, its
    inverse, each row's token and scale, and the experts' offsets, bit for bit."""
    device = "cpu" if INTERPRETER else "cuda"
    gen = torch.Generator().manual_seed(tokens)
    top_i = torch.rand(tokens, experts + foreign, generator=gen).topk(k, dim=-1).indices.to(device)
    if experts == 64:  # most experts get no pair
        top_i = top_i % 3
    scales = torch.rand(tokens, 1, generator=gen).to(device)
    got = moe_routing.pair_layout_triton(top_i, experts, foreign, scales)
    want = moe_routing.pair_layout_reference(top_i, experts, foreign, scales)
    assert torch.equal(got.offs, want.offs) and got.offs.dtype == torch.int32
    assert torch.equal(got.pos, want.pos) and torch.equal(got.source, want.source)
    assert torch.equal(got.row_scales, want.row_scales)
    assert sorted(got.pos.tolist()) == list(range(tokens * k))  # every pair a row of its own


def test_steps_too_long_for_one_program_to_lay_out_take_the_separate_kernels():
    logits = torch.randn(route_align.MAX_TOKENS + 1, 16)
    assert not route_align.supports(logits, 4)
    top_w, top_i, aligned = route_align.route_and_align(logits, 4, None, 16, 8)  # off CUDA: the torch references
    ref_w, ref_i, ref = route_align.route_align_reference(logits, 4, 0, 16, 16, 8)
    assert torch.equal(top_i, ref_i) and torch.equal(aligned.sorted_ids, ref.sorted_ids)
    assert torch.equal(aligned.block_expert, ref.block_expert)
    assert not route_align.supports(torch.randn(4, 16), 3)  # k must be a power of two


# ---- the model reads what the fused launches write ------------------------------------------------------------------

def fp8_linear_layer(k: int, n: int, block, seed: int):
    from workers.model import fp8
    from workers.model.layers import Fp8Linear

    layer = Fp8Linear(k, n, False, block)
    weight, scale = fp8.quantize_weight_blocks(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05,
                                               block)
    layer.weight.data, layer.weight_scale.data = weight, scale
    return layer


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The Triton paths of the norms, the FP8 GEMM, routing and the fused MoE on CPU tensors (the interpreter)."""
    from workers.model import fused_moe

    monkeypatch.setattr(fp8_gemm, "on_triton", lambda t: True)
    monkeypatch.setattr(moe_routing, "on_triton", lambda t: True)
    monkeypatch.setattr(fused_norm_rope, "supports", lambda x: True)
    monkeypatch.setattr(fused_moe, "supports", lambda x: True)
    monkeypatch.setattr(norm_quant, "supports", lambda x, group: norm_quant.FUSED)


@interpreter
@pytest.mark.parametrize("block", [(128, 128), (1, 1 << 30)], ids=["128x128-blocks", "per-channel"])
def test_an_fp8_projection_reads_the_rows_its_norm_quantised_in_the_same_launch(kernels_on_cpu, monkeypatch, block):
    from workers.checkpoint_quant import BlockShape
    from workers.model.layers import RMSNorm
    from workers.model.norm_quant import Fp8Rows

    x, residual, weight = rows("cpu", torch.float32, 5, 256, seed=3)
    norm, linear = RMSNorm(256, EPS), fp8_linear_layer(256, 384, BlockShape(*block), seed=4)
    norm.weight.data = weight
    h, total = norm.norm_for(x, residual, linear)
    assert isinstance(h, Fp8Rows) and h.rows is None and h.group == (128 if block[0] == 128 else 256)
    got = linear(h)
    monkeypatch.setattr(norm_quant, "FUSED", False)
    normed, want_total = norm.norm_for(x, residual, linear)  # the add-and-norm kernel alone, then the layer quantises
    assert isinstance(normed, torch.Tensor) and torch.equal(total, want_total)
    assert torch.equal(got, fp8_gemm.fp8_linear(normed, linear.weight, linear.weight_scale, linear.block))
    other = BlockShape(1, 1 << 30) if block[0] == 128 else BlockShape(128, 128)
    with pytest.raises(ValueError, match="groups of"):  # rows quantised for another layer's GEMM
        fp8_linear_layer(256, 384, other, seed=5)(h)


@interpreter
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["all-experts", "expert-parallel-rank"])
def test_an_fp8_moe_block_reads_its_norms_fp8_rows_and_the_alignment_its_routers_launch_made(
        kernels_on_cpu, monkeypatch, expert_parallel):
    from workers.model import fp8, fused_moe
    from workers.checkpoint_quant import BlockShape
    from workers.model.layers import RMSNorm
    from workers.model.moe import SparseMoeBlock
    from workers.parallel import TensorParallel

    gen = torch.Generator().manual_seed(5)
    tp = TensorParallel(rank=1, size=2, expert_parallel=True) if expert_parallel else None
    block = SparseMoeBlock(8, 2, 256, 128, tp, BlockShape(128, 128))
    block.gate.weight.data = torch.randn(8, 256, generator=gen)
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(block.experts, name)
        q, s = fp8.quantize_weight_blocks(torch.randn(w.shape, generator=gen) * 0.05, BlockShape(128, 128))
        w.data, getattr(block.experts, name.replace("proj", "scale")).data = q, s
    x, residual, weight = rows("cpu", torch.float32, 12, 256, seed=6)  # 12 tokens: the tiled path
    norm = RMSNorm(256, EPS)
    norm.weight.data = weight
    calls = []
    for module, name in ((route_align, "route_align"), (moe_routing, "align_pairs"), (fused_moe, "quantize_activations")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    h, _ = norm.norm_for(x, residual, block)
    got = block(h)
    assert calls == ["route_align"]  # no alignment and no quantisation of their own: the router's and the norm's
    calls.clear()
    monkeypatch.setattr(norm_quant, "FUSED", False)
    monkeypatch.setattr(route_align, "FUSED", False)
    normed, _ = norm.norm_for(x, residual, block)
    want = block(normed)
    assert calls == ["align_pairs", "quantize_activations"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def scaled_grouped_mm_in_float32(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """torch._scaled_grouped_mm's row-wise FP8 grouped GEMM in float32 (it has no CPU kernel): expert e's rows are
    offs[e - 1]:offs[e] of a; rows past the last offset (other ranks' pairs) are left zero."""
    out, start = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype), 0
    for e, end in enumerate(offs.tolist()):
        rows = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = (rows @ (b[e].float() * scale_b[e][None, :])).to(out_dtype)
        start = end
    return out


@interpreter
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["all-experts", "expert-parallel-rank"])
def test_grouped_fp8_experts_read_the_tokens_their_norm_quantised_and_compute_the_same(
        kernels_on_cpu, monkeypatch, expert_parallel):
    """Per-channel FP8 experts on the grouped path (long prompt steps) take the norm's e4m3 rows, one scale a
    token, instead of quantising the normed rows again."""
    from workers.model import fp8, grouped_fp8_moe, moe
    from workers.checkpoint_quant import BlockShape
    from workers.model.layers import RMSNorm
    from workers.model.moe import SparseMoeBlock
    from workers.model.norm_quant import Fp8Rows
    from workers.parallel import TensorParallel

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_in_float32, raising=False)
    monkeypatch.setattr(grouped_fp8_moe, "available", lambda device: True)
    monkeypatch.setattr(moe, "GROUPED_FP8_MIN_TOKENS", 8)
    gen = torch.Generator().manual_seed(8)
    per_channel = BlockShape(1, 1 << 30)
    tp = TensorParallel(rank=1, size=2, expert_parallel=True) if expert_parallel else None
    block = SparseMoeBlock(8, 2, 200, 96, tp, per_channel)  # 200 columns: one group of 256 a token
    block.gate.weight.data = torch.randn(8, 200, generator=gen)
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(block.experts, name)
        q, s = fp8.quantize_weight_blocks(torch.randn(w.shape, generator=gen) * 0.05, per_channel)
        w.data, getattr(block.experts, name.replace("proj", "scale")).data = q, s
    x, residual, weight = rows("cpu", torch.float32, 12, 200, seed=9)
    norm = RMSNorm(200, EPS)
    norm.weight.data = weight
    assert block.experts.path(x) == "grouped_fp8"
    calls = []
    original = grouped_fp8_moe.quantize_tokens
    monkeypatch.setattr(grouped_fp8_moe, "quantize_tokens", lambda x: (calls.append("quantize_tokens"), original(x))[1])
    h, _ = norm.norm_for(x, residual, block)
    assert isinstance(h, Fp8Rows) and h.group == 256 and h.scales.shape == (12, 1) and h.rows is not None
    got = block(h)
    assert calls == []  # the norm's launch quantised them
    monkeypatch.setattr(norm_quant, "FUSED", False)
    normed, _ = norm.norm_for(x, residual, block)
    want = block(normed)
    assert calls == ["quantize_tokens"]
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="one scale a token"):  # rows quantised for the tiled path's 128 columns
        grouped_fp8_moe.token_rows(Fp8Rows(h.q, h.scales.repeat(1, 2), 128, h.dtype, h.rows), x)


def one_layer_model(block: tuple[int, int] | None, device: str = "cuda"):
    """A one-layer text tower at Qwen3-VL-30B-A3B's shapes, random weights (FP8 in `block`s, or bf16)."""
    from workers.checkpoint_quant import BlockShape
    from workers.model.text import Qwen3VLTextForEngine
    from workers.model_config import TextConfig
    from workers.weights import init_random_fp8_weights, init_random_weights

    cfg = TextConfig(vocab_size=4096, hidden_size=2048, intermediate_size=6144, num_hidden_layers=1,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=EPS, rope_theta=5e6,
                     mrope_section=[24, 20, 20], attention_bias=False, max_position_embeddings=4096, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768)
    precision = (lambda name: None) if block is None else (lambda name: BlockShape(1, block[1]))
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen3VLTextForEngine(cfg, None, precision)
    finally:
        torch.set_default_dtype(torch.float32)
    model.to_empty(device=device)
    init_random_weights(model, 0)
    init_random_fp8_weights(model, 0)
    model.finish_loading(torch.device(device), scale_rows=block[0] if block else 1)
    return model.eval()


def kernels_of_one_step(model, tokens: int) -> tuple[torch.Tensor, int]:
    hidden, names = kernel_names_of_one_step(model, tokens)
    return hidden, len(names)


def kernel_names_of_one_step(model, tokens: int) -> tuple[torch.Tensor, list[str]]:
    """The model's output for a step of `tokens` prompt rows and the kernels it launched (copies and fills left
    out), after a first step that compiles."""
    from torch.profiler import ProfilerActivity, profile

    from lab.bench.engine_probes import gpu_timeline
    from workers.executor.decode_graphs import full_budget_batch
    from workers.kv_cache import KvCache

    batch, blocks = full_budget_batch(tokens, 4096, 16)
    kv = KvCache(1, blocks + 1, 16, 4, 128, torch.bfloat16, torch.device("cuda"))
    args = (batch.input_ids.cuda(), batch.positions.cuda(), batch.metadata(torch.device("cuda"), 16), kv.layers)
    with torch.inference_mode():
        model(*args)  # compiles
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            hidden = model(*args)
            torch.cuda.synchronize()
    return hidden, [name for name, _, _ in gpu_timeline(prof) if not name.startswith(("Memcpy", "Memset"))]


@pytest.mark.parametrize("block,fewer", [pytest.param(b, f, marks=gpu) for b, f in (
    ((1, 1 << 30), 4), ((128, 128), 4), (None, 2))], ids=["fp8-per-channel", "fp8-128x128", "bf16"])
def test_a_layer_launches_fewer_kernels_with_the_fused_launches_and_computes_the_same(monkeypatch, block, fewer):
    """The norm before attention and the one before the MoE each quantise in their launch (FP8), and the router's
    launch aligns the pairs (three launches one): 4 launches fewer a layer in FP8, 2 in bf16."""
    model = one_layer_model(block)
    fused, n_fused = kernels_of_one_step(model, 64)
    monkeypatch.setattr(norm_quant, "FUSED", False)
    monkeypatch.setattr(route_align, "FUSED", False)
    unfused, n_unfused = kernels_of_one_step(model, 64)
    assert n_unfused - n_fused == fewer
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_long_prompt_step_lays_its_experts_rows_out_without_a_sort_and_computes_the_same(monkeypatch):
    """From GROUPED_FP8_MIN_TOKENS tokens per-channel FP8 experts take the grouped GEMMs: with the fused launches
    the norm quantises their tokens and two launches lay the pairs' rows out, where the unfused step quantises
    again and sorts (a radix sort, histc, index ops): at least 2 + 8 launches fewer."""
    model = one_layer_model((1, 1 << 30))
    fused, fused_names = kernel_names_of_one_step(model, 2048)
    monkeypatch.setattr(norm_quant, "FUSED", False)
    monkeypatch.setattr(route_align, "FUSED", False)
    unfused, unfused_names = kernel_names_of_one_step(model, 2048)
    assert sum("_pair_layout_kernel" in n for n in fused_names) == 1
    assert not any("RadixSort" in n or "Histogram" in n for n in fused_names)
    assert any("RadixSort" in n for n in unfused_names) and not any("_pair_layout" in n for n in unfused_names)
    assert len(unfused_names) - len(fused_names) >= 10
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2e-2, atol=2e-2)

