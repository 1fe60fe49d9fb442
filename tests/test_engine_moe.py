"""The MoE experts' grouped-GEMM path computes what a plain per-token loop over the chosen experts computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model import moe
from workers.model.moe import SparseMoeBlock


def naive_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    top_w, top_i = block.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(top_w[t], top_i[t]):
            gate, up = F.linear(x[t], block.experts.gate_up_proj[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, block.experts.down_proj[e])
    return out


def make_block(seed: int) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_grouped_experts_match_a_per_token_loop(tokens):
    block = make_block(seed=tokens)
    x = torch.randn(tokens, 32)
    torch.testing.assert_close(block(x), naive_moe(block, x), rtol=1e-5, atol=1e-5)


def test_native_grouped_mm_and_the_reference_loop_agree(monkeypatch):
    if not moe._native_grouped_mm(torch.ones(1, 16), torch.ones(1, 16, 16)):
        pytest.skip("torch._grouped_mm has no kernel here")
    block = make_block(seed=7)
    x = torch.randn(33, 32)
    native = block(x)
    monkeypatch.setattr(moe, "_native_grouped_mm", lambda a, b: False)
    torch.testing.assert_close(block(x), native, rtol=1e-5, atol=1e-5)


def test_experts_that_get_no_tokens_are_skipped():
    a = torch.randn(6, 16)
    b = torch.randn(4, 16, 8)
    offs = torch.tensor([0, 3, 3, 6], dtype=torch.int32)  # experts 0 and 2 get nothing
    out = moe.grouped_mm(a, b, offs)
    torch.testing.assert_close(out, torch.cat([a[:3] @ b[1], a[3:] @ b[3]]))


def test_align_pairs_groups_every_pair_by_expert_in_padded_blocks():
    from workers.model.fused_moe import align_pairs

    torch.manual_seed(0)
    top_i = torch.stack([torch.randperm(6)[:2] for _ in range(9)])  # 9 tokens, top-2 of 6 experts
    sorted_ids, block_expert = align_pairs(top_i, num_experts=6, block_m=4)
    flat = top_i.reshape(-1)
    assert sorted(i for i in sorted_ids.tolist() if i < 18) == list(range(18))
    for b, expert in enumerate(block_expert.tolist()):
        ids = [i for i in sorted_ids[b * 4 : b * 4 + 4].tolist() if i < 18]
        if expert == 6:
            assert ids == []
        else:
            assert all(flat[i] == expert for i in ids)
