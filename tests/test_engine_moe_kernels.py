"""The MoE Triton kernels give what their torch references give: the router's top-k, the alignment of pairs into
expert blocks, the small-batch GEMV path and the tiled path, including pairs of another rank's experts and experts
that get no pair (Triton's interpreter on CPU with TRITON_INTERPRET=1; the real 30B-A3B shapes on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from workers.model import fused_moe, moe_routing
from workers.model.moe import MoeExperts, SparseMoeBlock

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and moe_routing.triton is not None
interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def routing(tokens: int, experts: int, k: int, seed: int, only: list[int] | None = None) -> torch.Tensor:
    """top_i [tokens, k]: k distinct experts per token, drawn from `only` when given."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(only if only is not None else range(experts))
    return torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(tokens)])


def random_experts(num_experts: int, hidden: int, inter: int, seed: int, device="cpu", dtype=torch.float32) -> MoeExperts:
    torch.manual_seed(seed)
    experts = MoeExperts(num_experts, hidden, inter)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.05 if hidden > 256 else 0.3)
    return experts.to(device, dtype)


ALIGN_CASES = {
    "one-token-block-1": (1, 8, 2, 1, False, None),
    "nine-tokens": (9, 6, 2, 4, False, None),
    "several-chunks-foreign": (300, 16, 4, 16, True, None),
    "empty-experts": (40, 16, 2, 4, False, [0, 5, 15]),
}


@pytest.mark.parametrize("num_experts,foreign", [(16, False), (255, True), (256, True), (300, False)])
def test_pairs_sort_by_expert_stably_with_keys_in_the_narrowest_type(num_experts, foreign):
    """sort_pairs sorts expert ids as uint8 up to 256 bins (one radix pass on CUDA), int16 above: the stable order
    of the ids themselves, another rank's pairs (id num_experts) last."""
    top_i = routing(400, num_experts, 4, seed=1)
    if foreign:
        top_i[::7, 0] = num_experts
    flat = top_i.reshape(-1)
    order, offs = moe_routing.sort_pairs(top_i, num_experts, foreign)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(offs, torch.bincount(flat, minlength=num_experts + 1)[:num_experts].cumsum(0).to(torch.int32))
    bins = num_experts + foreign
    assert moe_routing.sort_keys(flat, bins).dtype == (torch.uint8 if bins <= 256 else torch.int16)


@interpreter
@pytest.mark.parametrize("case", ALIGN_CASES.values(), ids=ALIGN_CASES.keys())
def test_align_kernel_gives_the_reference_blocks(case):
    tokens, experts, k, block_m, foreign, only = case
    bins = experts + foreign  # a foreign pair has id == experts: one more bin
    top_i = routing(tokens, bins, k, seed=tokens, only=only)
    want_ids, want_experts = moe_routing.align_pairs_reference(top_i, bins, block_m)
    got_ids, got_experts = moe_routing.align_pairs_triton(top_i, bins, block_m)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_experts, want_experts)


@interpreter
@pytest.mark.parametrize("expert_range", [None, (4, 12)], ids=["all-experts", "expert-parallel-rank"])
def test_router_kernel_picks_the_reference_top_k_and_weights(expert_range):
    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    lo, hi = expert_range or (0, 16)
    want_w, want_i = moe_routing.route_reference(logits, 4, lo, hi)
    got_w, got_i = moe_routing.route_triton(logits, 4, lo, hi)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)


@interpreter
@pytest.mark.parametrize("tokens,foreign,inter,block_n", [(1, False, 32, None), (3, True, 24, None), (2, True, 24, 16)],
                         ids=["one-token", "foreign-pairs-ragged-k", "ragged-columns"])
def test_small_batch_kernels_match_the_grouped_reference(monkeypatch, tokens, foreign, inter, block_n):
    if block_n:  # 24 intermediate columns are not a multiple of 16: the column masks
        monkeypatch.setattr(fused_moe, "GEMV_GATED", fused_moe.TileConfig(1, block_n, 32, 4, 1))
        monkeypatch.setattr(fused_moe, "GEMV_DOWN", fused_moe.TileConfig(1, block_n, 16, 4, 1))
    experts = random_experts(8, 64, inter, seed=tokens)
    top_i = routing(tokens, 8 + foreign, 2, seed=tokens)
    top_w = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(2))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    got = fused_moe.small_batch_experts(x, top_w, top_i, experts.gate_up_proj.data, experts.down_proj.data)
    torch.testing.assert_close(got, experts.grouped(x, top_w, top_i, foreign), rtol=1e-4, atol=1e-4)


@interpreter
def test_tiled_path_with_the_align_kernel_matches_the_grouped_reference(monkeypatch):
    monkeypatch.setattr(moe_routing, "on_triton", lambda t: True)  # the Triton align on CPU tensors
    experts = random_experts(8, 64, 32, seed=0)
    top_i = routing(20, 9, 2, seed=0, only=[0, 1, 2, 4, 7, 8])  # experts 3, 5, 6 idle; 8 is another rank's
    top_w = torch.rand(20, 2, generator=torch.Generator().manual_seed(2))
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(3))
    got = fused_moe.tiled_experts(x, top_w, top_i, experts.gate_up_proj.data, experts.down_proj.data, foreign=True)
    torch.testing.assert_close(got, experts.grouped(x, top_w, top_i, True), rtol=1e-4, atol=1e-4)


@interpreter
@pytest.mark.parametrize("inter", [32, 24], ids=["even", "ragged-n-and-k"])
def test_weight_tiles_through_tma_match_the_grouped_reference(monkeypatch, inter):
    """TileConfig.tma on the interpreter; inter 24: the gated GEMM's second column tile runs into the up rows and
    the down GEMM's K tile (32) past K (the descriptor reads zeros there)."""
    monkeypatch.setattr(fused_moe, "tile_config", lambda *args: fused_moe.TileConfig(16, 16, 32, 4, 1, 1, tma=1))
    experts = random_experts(8, 64, inter, seed=inter)
    top_i = routing(40, 8, 2, seed=1)
    top_w = torch.rand(40, 2, generator=torch.Generator().manual_seed(2))
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    got = fused_moe.tiled_experts(x, top_w, top_i, experts.gate_up_proj.data, experts.down_proj.data)
    torch.testing.assert_close(got, experts.grouped(x, top_w, top_i), rtol=1e-4, atol=1e-4)


@interpreter
@pytest.mark.parametrize("group_m", [0, 1, 3], ids=["column-order", "columns-first", "groups-of-3-ragged-last"])
def test_every_launch_order_of_the_tiles_matches_the_grouped_reference(monkeypatch, group_m):
    """Every expert gets 17 pairs: 16 full blocks of 16 rows (none padding-only) over 2 (gated) and 4 (down)
    column blocks, so groups of 3 row blocks end with a group of 1."""
    monkeypatch.setattr(fused_moe, "tile_config", lambda *args: fused_moe.TileConfig(16, 16, 32, 4, 1, group_m))
    experts = random_experts(8, 64, 32, seed=group_m)
    token = torch.randperm(68, generator=torch.Generator().manual_seed(group_m))
    top_i = torch.stack([token % 8, (token + 4) % 8], dim=1)
    top_w = torch.rand(68, 2, generator=torch.Generator().manual_seed(2))
    x = torch.randn(68, 64, generator=torch.Generator().manual_seed(3))
    assert fused_moe.align_pairs(top_i, 8, 16)[1].lt(8).all()
    got = fused_moe.tiled_experts(x, top_w, top_i, experts.gate_up_proj.data, experts.down_proj.data)
    torch.testing.assert_close(got, experts.grouped(x, top_w, top_i), rtol=1e-4, atol=1e-4)


def test_tuned_table_rows_are_looked_up_by_pair_count_five_numbers_mean_column_order_and_a_seventh_tma(monkeypatch, tmp_path):
    key = fused_moe.shape_key(8, 32, 64, True)
    (tmp_path / "Some_GPU.json").write_text(
        f'{{"{key}": [[4096, [64, 128, 64, 4, 4, 8]], [64, [16, 64, 128, 4, 5]], [65536, [128, 128, 64, 8, 4, 1, 1]]]}}')
    monkeypatch.setattr(fused_moe, "TUNED_DIR", tmp_path)
    fused_moe._tuned.cache_clear()
    try:
        configs = [fused_moe.tile_config(pairs, True, key, "Some GPU") for pairs in (10, 64, 65, 4096, 10**6)]
    finally:
        fused_moe._tuned.cache_clear()
    assert configs[0] == configs[1] == fused_moe.TileConfig(16, 64, 128, 4, 5, group_m=0)
    assert configs[2] == configs[3] == fused_moe.TileConfig(64, 128, 64, 4, 4, group_m=8, tma=0)
    assert configs[4] == fused_moe.TileConfig(128, 128, 64, 8, 4, group_m=1, tma=1)


@pytest.mark.parametrize("device_name", ["NVIDIA H200", None])
@pytest.mark.parametrize("max_tokens", [8192, 16384, 1000])
def test_warm_up_steps_take_every_tile_config_pair_a_step_can_take(device_name, max_tokens):
    gate_up = torch.empty(128, 2 * 768, 2048, device="meta")  # the 30B shape: only the shape is read
    keys = fused_moe.shape_key(128, 768, 2048, True), fused_moe.shape_key(128, 2048, 768, False)

    def configs(tokens):
        return tuple(fused_moe.tile_config(tokens * 8, gated, key, device_name) for gated, key in zip((True, False), keys))

    tokens = fused_moe.warm_up_tokens(gate_up, 8, max_tokens, device_name)
    reachable = {configs(t) for t in range(fused_moe.SMALL_BATCH_TOKENS + 1, max_tokens + 1)}
    assert {configs(t) for t in tokens} == reachable
    assert len(tokens) == len(reachable)  # one step per pair of configs
    assert all(fused_moe.SMALL_BATCH_TOKENS < t <= max_tokens for t in tokens)
    if device_name and max_tokens >= 8192:  # the shipped H200 table: 9-64, 65-256, 257-1024, 1025-4096, 4097+ tokens
        assert len(tokens) >= 4


# --- CUDA, Qwen3-VL-30B-A3B shapes (128 experts, top-8, hidden 2048, moe_intermediate 768), bfloat16 ---

def block_30b(seed: int) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(128, 8, 2048, 768).cuda().bfloat16()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    return block


def float64_moe(experts: MoeExperts, x, top_w, top_i) -> torch.Tensor:
    """sum_k w * down(silu(gate x) * up x) in float64, expert by expert; ids >= E add zero."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for expert in top_i.unique().tolist():
        if expert >= experts.num_experts:
            continue
        token, slot = (top_i == expert).nonzero(as_tuple=True)
        gate, up = (x[token].double() @ experts.gate_up_proj[expert].double().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ experts.down_proj[expert].double().T
        out.index_add_(0, token, y * top_w[token, slot].double().unsqueeze(-1))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("tokens", [pytest.param(t, marks=gpu) for t in (1, 2, 8, 64, 8192, 16384)])
def test_fused_moe_layer_matches_float64_at_30b_shapes(tokens):
    """T <= 8: the router kernel and the GEMV path; above: the router kernel, the align kernel and the tiles."""
    block = block_30b(seed=tokens)
    x = torch.randn(tokens, 2048, device="cuda").bfloat16()
    top_w, top_i = block.gate(x)
    ref = float64_moe(block.experts, x, top_w, top_i)
    got = block(x)
    assert torch.isfinite(got).all()
    assert rel(got, ref) < 1e-2
    assert rel(got, block.experts.grouped(x, top_w, top_i)) < 1e-2


@pytest.mark.parametrize("group_m", [pytest.param(g, marks=gpu) for g in (0, 1, 8)])
def test_every_launch_order_matches_float64_at_30b_prefill_shapes(monkeypatch, group_m):
    """4096 tokens (32768 pairs) with the prefill tiles in each launch order."""
    tiles = {True: fused_moe.TileConfig(128, 128, 64, 8, 4, group_m), False: fused_moe.TileConfig(128, 256, 64, 8, 3, group_m)}
    monkeypatch.setattr(fused_moe, "tile_config", lambda pairs, gated, *args: tiles[gated])
    block = block_30b(seed=group_m)
    x = torch.randn(4096, 2048, device="cuda").bfloat16()
    top_w, top_i = block.gate(x)
    got = fused_moe.tiled_experts(x, top_w, top_i, block.experts.gate_up_proj, block.experts.down_proj)
    assert rel(got, float64_moe(block.experts, x, top_w, top_i)) < 1e-2


@pytest.mark.parametrize("inter", [pytest.param(i, marks=gpu) for i in (768, 80)], ids=["30b", "ragged-n-and-k"])
def test_weight_tiles_through_tma_give_the_pointer_loads_result(monkeypatch, inter):
    """TileConfig.tma: the same products from the same tiles, so the same bits. inter 80: the gated GEMM's last
    column tile runs past N into the up rows and the down GEMM's last K tile past K (TMA reads zeros there)."""
    torch.manual_seed(inter)
    block = SparseMoeBlock(128, 8, 2048, inter).cuda().bfloat16()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    x = torch.randn(2048, 2048, device="cuda").bfloat16()
    top_w, top_i = block.gate(x)
    outs = {}
    for tma in (0, 1):
        tiles = {True: fused_moe.TileConfig(128, 64, 64, 8, 3, 1, tma), False: fused_moe.TileConfig(128, 256, 64, 8, 3, 1, tma)}
        monkeypatch.setattr(fused_moe, "tile_config", lambda pairs, gated, *args, tiles=tiles: tiles[gated])
        outs[tma] = fused_moe.tiled_experts(x, top_w, top_i, block.experts.gate_up_proj, block.experts.down_proj)
    assert torch.equal(outs[1], outs[0])
    assert rel(outs[1], float64_moe(block.experts, x, top_w, top_i)) < 1e-2


@pytest.mark.parametrize("tokens", [pytest.param(t, marks=gpu) for t in (1, 300, 16384)])
def test_k_sum_kernel_equals_torch_sum(tokens):
    ys = torch.randn(tokens * 8, 2048, device="cuda").bfloat16()
    assert torch.equal(fused_moe.k_sum(ys, 8), ys.view(tokens, 8, 2048).sum(dim=1))


def test_k_sum_on_cpu_is_torch_sum():
    ys = torch.randn(3 * 8, 40).bfloat16()
    assert torch.equal(fused_moe.k_sum(ys, 8), ys.view(3, 8, 40).sum(dim=1))


@pytest.mark.parametrize("tokens", [pytest.param(t, marks=gpu) for t in (1, 8, 64, 300)])
def test_pairs_of_another_ranks_experts_add_zero_at_30b_shapes(tokens):
    """Expert parallelism over two ranks: this rank holds experts 0-63; pairs routed to 64-127 get id 64."""
    experts = random_experts(64, 2048, 768, seed=tokens, device="cuda", dtype=torch.bfloat16)
    top_i = routing(tokens, 128, 8, seed=tokens).clamp(max=64).cuda()
    top_w = torch.rand(tokens, 8, device="cuda").bfloat16()
    x = torch.randn(tokens, 2048, device="cuda").bfloat16()
    ref = float64_moe(experts, x, top_w, top_i)
    got = fused_moe.fused_experts(x, top_w, top_i, experts.gate_up_proj, experts.down_proj, foreign=True)
    assert rel(got, ref) < 1e-2
    assert rel(got, experts.grouped(x, top_w, top_i, foreign=True)) < 1e-2


@pytest.mark.parametrize("tokens", [pytest.param(t, marks=gpu) for t in (1, 64, 8192)])
def test_router_kernel_matches_torch_at_30b_shapes(tokens):
    """bf16 logits tie often among 128 experts; a tie may be broken the other way, so the chosen logits (not the
    ids) must agree, and the weights."""
    block = block_30b(seed=1)
    logits = F.linear(torch.randn(tokens, 2048, device="cuda").bfloat16(), block.gate.weight)
    want_w, want_i = moe_routing.route_reference(logits, 8, 0, 128)
    got_w, got_i = moe_routing.route_triton(logits, 8, 0, 128)
    assert torch.equal(logits.gather(1, got_i).sort(dim=1).values, logits.gather(1, want_i).sort(dim=1).values)
    torch.testing.assert_close(got_w.sort(dim=1).values, want_w.sort(dim=1).values, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("block_m,foreign", [pytest.param(m, f, marks=gpu) for m, f in ((16, False), (128, False), (64, True))])
def test_align_kernel_equals_the_reference_at_65k_pairs(block_m, foreign):
    top_i = torch.rand(8192, 128 + foreign, device="cuda").topk(8, dim=-1).indices
    want = moe_routing.align_pairs_reference(top_i, 128 + foreign, block_m)
    got = moe_routing.align_pairs_triton(top_i, 128 + foreign, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("tokens", [pytest.param(t, marks=gpu) for t in (1, 8, 64)])
def test_moe_layer_replays_in_a_cuda_graph(tokens):
    block = block_30b(seed=2)
    x = torch.randn(tokens, 2048, device="cuda").bfloat16()
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, block(x))
