"""The text tower's fusions give what the unfused modules give: q/k/v (and dense gate/up) as one weight after either
load format and under tensor parallelism; Triton RMSNorm, residual add + RMSNorm and q/k norm + MRoPE + KV write
equal the torch reference (Triton's interpreter on CPU with TRITON_INTERPRET=1; the real shapes on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.fp8_kv_reference import e4m3_bytes, probe_values
from workers.config import EngineConfig
from workers.executor.model_runner import build_text_model
from workers.kv_cache import FP8_DTYPE, quantize_fp8
from workers.model import fused_norm_rope
from workers.model.layers import MRotaryEmbedding, apply_rope, rms_norm_reference
from workers.model.text import Qwen3VLTextForEngine
from workers.model_config import load_model_config
from workers.parallel import TensorParallel
from workers.weights import TEXT_PREFIX, init_random_weights, iter_tensors

EPS = 1e-6


def checkpoint_tensor(checkpoint, name: str) -> torch.Tensor:
    return dict(iter_tensors(checkpoint, TEXT_PREFIX + name))[""]


def build(checkpoint, load_format: str, tp: TensorParallel | None = None):
    config = EngineConfig(checkpoint=checkpoint, load_format=load_format)
    return build_text_model(config, load_model_config(checkpoint), torch.device("cpu"), torch.float32, tp)


@pytest.mark.parametrize("rank", [None, 1], ids=["one-rank", "tp2-rank1"])
def test_fused_qkv_weight_is_this_ranks_q_k_v_rows_of_the_checkpoint_stacked(tiny_moe_checkpoint, rank):
    tp = None if rank is None else TensorParallel(rank=rank, size=2)
    attn = build(tiny_moe_checkpoint, "safetensors", tp).language_model.layers[1].self_attn
    parts = [checkpoint_tensor(tiny_moe_checkpoint, f"layers.1.self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")]
    if tp is not None:
        parts = [tp.shard(f"language_model.layers.1.self_attn.{p}.weight", w) for p, w in zip(("q_proj", "k_proj", "v_proj"), parts)]
    assert torch.equal(attn.qkv_proj.weight, torch.cat(parts))
    assert not hasattr(attn, "q_proj") and not hasattr(attn, "v_proj")  # one copy of the weights, not two


def test_random_load_format_fuses_the_same_draws_it_gave_the_separate_projections(tiny_moe_checkpoint):
    config = load_model_config(tiny_moe_checkpoint)
    with torch.device("meta"):
        unfused = Qwen3VLTextForEngine(config.text)
    unfused.to_empty(device="cpu")
    init_random_weights(unfused, EngineConfig(checkpoint=tiny_moe_checkpoint).seed)
    fused = build(tiny_moe_checkpoint, "random")
    for before, after in zip(unfused.language_model.layers, fused.language_model.layers):
        a = before.self_attn
        assert torch.equal(after.self_attn.qkv_proj.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))


def test_fused_gate_up_dense_mlp_equals_silu_gate_times_up(tiny_dense_checkpoint):
    mlp = build(tiny_dense_checkpoint, "safetensors").language_model.layers[0].mlp
    gate, up, down = (checkpoint_tensor(tiny_dense_checkpoint, f"layers.0.mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
    x = torch.randn(5, gate.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mlp(x), F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))


# ---- Triton kernels against the torch reference ------------------------------------------------------------------

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and fused_norm_rope.triton is not None
SHAPES = {  # (device, dtype, tokens, hidden, heads, kv heads, head_dim)
    "interpreter": [("cpu", torch.float32, 3, 96, 6, 2, 32), ("cpu", torch.bfloat16, 3, 96, 6, 2, 32)],
    "cuda": [("cuda", torch.bfloat16, t, 2048, 32, 4, 128) for t in (1, 64, 8192)],
}
CASES = [pytest.param(*s, marks=pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1"))
         for s in SHAPES["interpreter"]]
CASES += [pytest.param(*s, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])
          for s in SHAPES["cuda"]]


def tolerance(dtype: torch.dtype, device: str) -> dict:
    """float32: one rounding order apart. bf16: one bf16 step (the interpreter also casts by truncation)."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=2e-2, atol=2e-2 if device == "cuda" else 4e-2)


@pytest.mark.parametrize("device,dtype,tokens,hidden,heads,kv_heads,head_dim", CASES)
def test_triton_rms_norm_and_residual_add_norm_match_torch(device, dtype, tokens, hidden, heads, kv_heads, head_dim):
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(dtype)
    tol = tolerance(dtype, device)
    torch.testing.assert_close(fused_norm_rope.rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), **tol)
    normed, total = fused_norm_rope.add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(total, residual + x, **tol)
    torch.testing.assert_close(normed, rms_norm_reference(residual + x, weight, EPS), **tol)


@pytest.mark.parametrize("device,dtype,tokens,hidden,heads,kv_heads,head_dim", CASES)
def test_triton_qk_norm_rope_matches_torch_and_writes_k_v_into_their_slots(
    device, dtype, tokens, hidden, heads, kv_heads, head_dim
):
    gen = torch.Generator(device).manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, generator=gen).to(dtype)
    q_weight, k_weight = ((1 + 0.1 * torch.randn(head_dim, device=device, generator=gen)).to(dtype) for _ in range(2))
    section = [head_dim // 2 - 2 * (head_dim * 5 // 32), head_dim * 5 // 32, head_dim * 5 // 32]  # [24, 20, 20] at 128
    rotary = MRotaryEmbedding(head_dim, 5_000_000.0, section, torch.device(device))
    positions = torch.randint(0, 4096, (3, tokens), device=device, generator=gen)
    cos, sin = rotary.cos_sin(positions, dtype)
    block_size, num_blocks = 16, tokens // 16 + 4
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device=device, generator=gen)[:tokens]

    q, k, v = fused_norm_rope.qk_norm_rope_write_kv(
        qkv, q_weight, k_weight, cos, sin, EPS, heads, kv_heads, k_cache, v_cache, slots
    )
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    tol = tolerance(dtype, device)
    torch.testing.assert_close(q, apply_rope(rms_norm_reference(q_ref.view(tokens, heads, head_dim), q_weight, EPS), cos, sin), **tol)
    torch.testing.assert_close(k, apply_rope(rms_norm_reference(k_ref.view(tokens, kv_heads, head_dim), k_weight, EPS), cos, sin), **tol)
    assert torch.equal(v, v_ref.reshape(tokens, kv_heads, head_dim))
    assert torch.equal(k_cache.flatten(0, 1)[slots], k) and torch.equal(v_cache.flatten(0, 1)[slots], v)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert not k_cache.flatten(0, 1)[untouched].any()


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 0.053)])
@pytest.mark.parametrize("device,dtype,tokens,hidden,heads,kv_heads,head_dim", CASES)
def test_triton_qk_norm_rope_writes_an_fp8_cache_bit_exact_with_the_reference_quantizer(
    device, dtype, tokens, hidden, heads, kv_heads, head_dim, k_scale, v_scale
):
    gen = torch.Generator(device).manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, generator=gen).to(dtype)
    q_weight, k_weight = ((1 + 0.1 * torch.randn(head_dim, device=device, generator=gen)).to(dtype) for _ in range(2))
    section = [head_dim // 2 - 2 * (head_dim * 5 // 32), head_dim * 5 // 32, head_dim * 5 // 32]
    cos, sin = MRotaryEmbedding(head_dim, 5_000_000.0, section, torch.device(device)).cos_sin(
        torch.randint(0, 4096, (3, tokens), device=device, generator=gen), dtype)
    num_blocks = tokens // 16 + 4
    k_cache = torch.zeros(num_blocks, 16, kv_heads, head_dim, device=device, dtype=FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * 16, device=device, generator=gen)[:tokens]
    q, k, v = fused_norm_rope.qk_norm_rope_write_kv(
        qkv, q_weight, k_weight, cos, sin, EPS, heads, kv_heads, k_cache, v_cache, slots, k_scale, v_scale
    )
    assert q.dtype == k.dtype == v.dtype == dtype  # the step's own rows stay in the activation dtype
    stored_k, stored_v = (c.flatten(0, 1)[slots].view(torch.uint8).cpu() for c in (k_cache, v_cache))
    assert torch.equal(stored_k, quantize_fp8(k.cpu(), k_scale).view(torch.uint8))
    assert torch.equal(stored_v, quantize_fp8(v.cpu(), v_scale).view(torch.uint8))
    assert torch.equal(stored_v, e4m3_bytes(v.cpu(), v_scale))


if fused_norm_rope.triton is not None:
    import triton.language as tl

    @fused_norm_rope.triton.jit
    def _quantize_rows(x_ptr, y_ptr, scale, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, fused_norm_rope._quantize_e4m3(tl.load(x_ptr + offs, mask=mask), scale), mask=mask)


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37])  # 0.5 keeps the ties ties
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_the_kernels_fp8_rounding_is_the_reference_on_every_e4m3_value_tie_and_overflow(device, scale):
    x = probe_values().to(device)
    y = torch.empty(x.shape, dtype=FP8_DTYPE, device=device)
    _quantize_rows[(fused_norm_rope.triton.cdiv(x.numel(), 1024),)](x, y, scale, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.uint8).cpu(), e4m3_bytes(x.cpu(), scale))
