"""The vision tower's Triton kernels equal their torch references: residual add + LayerNorm (with and without a
pending add) and the q/k rotary (Triton's interpreter on CPU with TRITON_INTERPRET=1; the real shapes on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from workers.model import vision_kernels as vk

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and vk.triton is not None
ON_INTERPRETER = pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1")
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or vk.triton is None, reason="needs CUDA and triton")]

# (device, dtype, rows, width): the interpreter's small shapes; on CUDA the 30B tower's 16 x 1024 patches (hidden
# 1152) and its post-shuffle DeepStack rows (4 x 1152).
NORM_CASES = [pytest.param("cpu", dt, 5, 40, marks=ON_INTERPRETER) for dt in (torch.float32, torch.bfloat16)]
NORM_CASES += [pytest.param("cuda", torch.bfloat16, rows, width, marks=ON_CUDA) for rows, width in ((16384, 1152), (4096, 4608))]
# (device, dtype, tokens, heads, head_dim): head_dim 72 = two halves of 36, neither a power of two.
ROTARY_CASES = [pytest.param("cpu", dt, 21, 3, 24, marks=ON_INTERPRETER) for dt in (torch.float32, torch.bfloat16)]
ROTARY_CASES += [pytest.param("cuda", torch.bfloat16, tokens, 16, 72, marks=ON_CUDA) for tokens in (1, 16384)]


def tolerance(dtype: torch.dtype) -> dict:
    """float32: rounding order apart. bf16: one bf16 step (the interpreter also casts by truncation)."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)


def draw(*shape, device, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator(device=device).manual_seed(seed), device=device).to(dtype)


@pytest.mark.parametrize("with_update", [True, False], ids=["pending-add", "first-block"])
@pytest.mark.parametrize("device,dtype,rows,width", NORM_CASES)
def test_add_layer_norm_kernel_equals_the_reference(device, dtype, rows, width, with_update):
    residual = draw(rows, width, device=device, dtype=dtype, seed=1) * 3 + 1
    update = draw(rows, width, device=device, dtype=dtype, seed=2) if with_update else None
    weight = 1 + 0.1 * draw(width, device=device, dtype=dtype, seed=3)
    bias = 0.1 * draw(width, device=device, dtype=dtype, seed=4)
    normed, new_residual = vk.add_layer_norm_triton(residual, update, weight, bias, 1e-6)
    want_normed, want_residual = vk.add_layer_norm_reference(residual, update, weight, bias, 1e-6)
    assert normed.dtype == new_residual.dtype == dtype
    torch.testing.assert_close(new_residual, want_residual, **tolerance(dtype))
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))
    if not with_update:
        assert new_residual is residual  # nothing pending: the residual passes through


@pytest.mark.parametrize("device,dtype,tokens,heads,head_dim", ROTARY_CASES)
def test_rotary_kernel_equals_the_reference_and_leaves_v_in_place(device, dtype, tokens, heads, head_dim):
    qkv = draw(tokens, 3 * heads * head_dim, device=device, dtype=dtype, seed=5)
    angles = draw(tokens, head_dim // 2, device=device, seed=6) * 3
    cos, sin = angles.cos(), angles.sin()
    q, k, v = vk.rotary_qk_triton(qkv, cos, sin, heads)
    want_q, want_k, want_v = vk.rotary_qk_reference(qkv, cos, sin, heads)
    assert q.shape == k.shape == (tokens, heads, head_dim) and q.is_contiguous() and k.is_contiguous()
    torch.testing.assert_close(q, want_q, **tolerance(dtype))
    torch.testing.assert_close(k, want_k, **tolerance(dtype))
    assert torch.equal(v, want_v) and v.data_ptr() == qkv.data_ptr() + 2 * heads * head_dim * qkv.element_size()


def test_rotary_reference_is_transformers_rotation():
    """x * cos + rotate_half(x) * sin with HF's full tables (each half-table repeated), in float32, one rounding."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    tokens, heads, head_dim = 7, 2, 16
    qkv = draw(tokens, 3 * heads * head_dim, device="cpu", dtype=torch.bfloat16, seed=7)
    angles = draw(tokens, head_dim // 2, device="cpu", seed=8)
    q, k, _ = vk.rotary_qk_reference(qkv, angles.cos(), angles.sin(), heads)
    full = torch.cat([angles, angles], dim=-1)
    raw_q, raw_k, _ = qkv.view(tokens, 3, heads, head_dim).unbind(1)
    want_q, want_k = apply_rotary_pos_emb_vision(raw_q, raw_k, full.cos(), full.sin())
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_kernels_run_only_on_cuda_tensors():
    assert not vk.supports(torch.zeros(2))
