"""On CUDA in bfloat16 the engine (Triton paged decode, grouped-GEMM MoE, CUDA graphs) generates what
transformers generates, up to a first divergence that float32 transformers cannot tell from bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.bf16_reference import (MAX_PIXELS, MIN_PIXELS, TransformersReference, bf16_cases,
                                          run_engine_and_compare)
from workers.config import EngineConfig
from workers.engine import LLMEngine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["moe", "dense"])
def checkpoint(request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return request.getfixturevalue(f"tiny_{request.param}_checkpoint")


@pytest.fixture(scope="module")
def cases(checkpoint):
    return bf16_cases(TransformersReference(checkpoint, "cuda"))


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_engine_matches_transformers_in_bfloat16_on_cuda(checkpoint, cases, enforce_eager):
    engine = LLMEngine.from_config(EngineConfig(
        checkpoint=checkpoint, device="cuda", dtype="bfloat16", num_kv_blocks=256, block_size=16, max_model_len=1024,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_num_seqs=8, enforce_eager=enforce_eager,
    ))
    assert (engine.executor.graphs is not None) is not enforce_eager
    run_engine_and_compare(engine, cases)


def test_triton_paged_decode_matches_sdpa_over_gathered_blocks():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workers.model.attention import gather_kv
    from workers.model.paged_decode import decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 32, 4, 128, 16, 300
    lens = [1, 17, 255, 1024, 700]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    tables = torch.stack([perm[i * 5 : i * 5 + 64] for i in range(len(lens))])
    q = torch.randn(len(lens), heads, head_dim, device="cuda", generator=gen).bfloat16()
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), 0.088, out)
    for i, n in enumerate(lens):
        k = gather_kv(k_cache, tables[i], n).transpose(0, 1).unsqueeze(0).double()
        v = gather_kv(v_cache, tables[i], n).transpose(0, 1).unsqueeze(0).double()
        ref = F.scaled_dot_product_attention(q[i, :, None].double().unsqueeze(0), k, v, scale=0.088, enable_gqa=True)
        ref = ref[0, :, 0]
        err = (out[i].double() - ref).norm() / ref.norm()
        assert err < 1e-2, (n, float(err))


def _random_moe_block(num_experts, top_k, hidden, inter, seed):
    from workers.model import moe

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(seed)
    block = moe.SparseMoeBlock(num_experts, top_k, hidden, inter).cuda().bfloat16()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    return block


def _float64_moe(block, x, top_w, top_i):
    """sum_k w * down(silu(gate x) * up x) in float64, expert by expert."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for expert in top_i.unique().tolist():
        token, slot = (top_i == expert).nonzero(as_tuple=True)
        gate, up = (x[token].double() @ block.experts.gate_up_proj[expert].double().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ block.experts.down_proj[expert].double().T
        out.index_add_(0, token, y * top_w[token, slot].double().unsqueeze(-1))
    return out


def test_grouped_mm_moe_on_cuda_matches_float64():
    block = _random_moe_block(16, 4, 256, 128, seed=0)
    x = torch.randn(77, 256, device="cuda").bfloat16()
    top_w, top_i = block.gate(x)
    ref = _float64_moe(block, x, top_w, top_i)
    got = block.experts.grouped(x, top_w, top_i).double()
    assert (got - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("tokens", [1, 3, 64, 700, 3000])
def test_fused_triton_moe_matches_float64_at_30b_shapes(tokens):
    """Every tile configuration (decode to prefill sizes) of the fused kernels, 30B-A3B expert shapes."""
    from workers.model import fused_moe

    block = _random_moe_block(128, 8, 2048, 768, seed=tokens)
    x = torch.randn(tokens, 2048, device="cuda").bfloat16()
    top_w, top_i = block.gate(x)
    ref = _float64_moe(block, x, top_w, top_i)
    e = block.experts
    got = fused_moe.fused_experts(x, top_w, top_i, e.gate_up_proj, e.down_proj)
    assert torch.isfinite(got).all()
    assert (got.double() - ref).norm() / ref.norm() < 1e-2
    assert (got - e.grouped(x, top_w, top_i)).double().norm() / ref.norm() < 1e-2
