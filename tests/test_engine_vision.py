"""The vision tower: our forward over transformers' vision module gives what the module gives (float32 on the CPU at
a tiny shape; bf16 on CUDA at the 30B shape), the patch embedding run as a GEMM equals the Conv3d, images of equal
size are planned into one attention run, and the per-grid tables are built once and kept within their budget."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading

import pytest
import torch
from torch import nn

from tests.helpers.vision_reference import GRIDS, pixels_for, randomized_module, relative_error, transformers_output
from workers.model.vision import GridTables, PatchLinear, VisionEncoder, VisionTower, frame_runs, shard_vision_blocks
from workers.model_config import CheckpointError, load_model_config
from workers.parallel import TensorParallel
from workers.tiny_checkpoint import released_config, transformers_config


def patch_conv(channels: int = 3, temporal: int = 2, patch: int = 16, out: int = 64) -> nn.Conv3d:
    torch.manual_seed(0)
    kernel = (temporal, patch, patch)
    return nn.Conv3d(channels, out, kernel_size=kernel, stride=kernel, bias=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_patch_linear_gives_the_convolutions_output(dtype, tol):
    conv = patch_conv().to(dtype)
    patches = torch.randn(37, 3, 2, 16, 16, dtype=dtype)
    expected = conv(patches).view(37, 64)
    got = PatchLinear(conv)(patches.view(37, -1))
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_patch_linear_shares_the_checkpoint_tensors():
    conv = patch_conv()
    linear = PatchLinear(conv)
    assert linear.weight is conv.weight and linear.bias is conv.bias


def test_an_overlapping_convolution_is_refused():
    conv = nn.Conv3d(3, 8, kernel_size=(2, 16, 16), stride=(2, 8, 8))
    with pytest.raises(ValueError, match="not a non-overlapping patch projection"):
        PatchLinear(conv)


def test_consecutive_frames_of_one_size_form_one_run():
    grid = torch.tensor([[1, 4, 4], [1, 4, 4], [1, 2, 6], [2, 4, 4]])
    assert frame_runs(grid) == [(16, 2), (12, 1), (16, 2)]


@pytest.fixture(scope="module")
def tiny_vision(tiny_moe_checkpoint):
    return randomized_module(load_model_config(tiny_moe_checkpoint).hf_config.vision_config, "cpu", torch.float32)


@torch.inference_mode()
def test_our_tower_equals_transformers_module_on_a_mixed_batch(tiny_vision):
    grid = torch.tensor(GRIDS)
    pixels = pixels_for(GRIDS, tiny_vision.patch_embed.proj.weight[0].numel())
    expected, expected_stack = transformers_output(tiny_vision, pixels, grid)
    embeds, stack = VisionTower(tiny_vision)(pixels, grid)
    assert embeds.shape == expected.shape == (pixels.shape[0] // 4, 64)
    torch.testing.assert_close(embeds, expected, rtol=1e-5, atol=1e-5)
    assert len(stack) == len(expected_stack) == 2
    for got, want in zip(stack, expected_stack):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_each_image_encodes_as_it_would_alone(tiny_vision):
    """Attention stays within each frame: an image's rows do not depend on its neighbours in the batch."""
    tower = VisionTower(tiny_vision)
    grid = torch.tensor(GRIDS)
    pixels = pixels_for(GRIDS, tiny_vision.patch_embed.proj.weight[0].numel())
    together, _ = tower(pixels, grid)
    first = GRIDS[0][0] * GRIDS[0][1] * GRIDS[0][2]
    alone, _ = tower(pixels[first:2 * first], grid[1:2])
    torch.testing.assert_close(together[first // 4:2 * first // 4], alone, rtol=1e-5, atol=1e-5)


def test_grid_tables_are_built_once_per_grid_and_kept_within_budget(tiny_vision):
    config = tiny_vision.config
    tables = GridTables(tiny_vision.pos_embed, tiny_vision.rotary_pos_emb.inv_freq, config.spatial_merge_size)
    pos, cos, sin = tables([(1, 4, 4), (1, 4, 4), (2, 2, 6)])
    assert pos.shape == (16 + 16 + 24, config.hidden_size) and cos.shape == sin.shape == (56, config.hidden_size // config.num_heads // 2)
    assert torch.equal(pos[:16], pos[16:32]) and torch.equal(pos[32:44], pos[44:])  # frames of a grid share them
    assert tables._get((1, 4, 4))[0] is tables._get((1, 4, 4))[0]
    small = GridTables(tiny_vision.pos_embed, tiny_vision.rotary_pos_emb.inv_freq, 2, budget_bytes=1)
    small([(1, 4, 4), (1, 2, 2)])
    assert list(small._tables) == [(1, 2, 2)]  # the least recently used grid went; the newest always stays


def test_a_grid_off_the_merge_size_is_refused(tiny_vision):
    tables = GridTables(tiny_vision.pos_embed, tiny_vision.rotary_pos_emb.inv_freq, 2)
    with pytest.raises(ValueError, match=r"image grid \(1, 3, 4\) is not a multiple of the spatial merge size 2"):
        tables([(1, 3, 4)])


def test_a_patch_count_that_disagrees_with_the_grid_is_refused(tiny_vision):
    pixels = torch.zeros(15, tiny_vision.patch_embed.proj.weight[0].numel())
    with pytest.raises(ValueError, match="pixel_values has 15 patches"):
        VisionTower(tiny_vision)(pixels, torch.tensor([[1, 4, 4]]))


def test_encoder_loads_the_checkpoints_vision_weights(tiny_moe_checkpoint):
    from workers.weights import VISION_PREFIX, iter_tensors, vision_module

    cpu, config = torch.device("cpu"), load_model_config(tiny_moe_checkpoint)
    encoder = VisionEncoder(config, vision_module(config, tiny_moe_checkpoint, cpu, torch.float32), cpu, torch.float32)
    state = dict(iter_tensors(tiny_moe_checkpoint, VISION_PREFIX))
    assert torch.equal(encoder.model.blocks[0].attn.qkv.weight, state["blocks.0.attn.qkv.weight"])
    assert encoder.model.rotary_pos_emb.inv_freq.dtype == torch.float32
    grid = torch.tensor([[1, 4, 4]])
    embeds, stack = encoder.encode(pixels_for([[1, 4, 4]], 1536), grid)
    assert embeds.shape == (4, 64) and len(stack) == 2


# ---- CUDA: the real 30B shape in bf16 ----------------------------------------------------------------------------

# bf16 through 27 blocks rounds differently from transformers' module (fused LayerNorm, rotary FMA, position-embedding
# sums; transformers 5.17 also sums those in bf16), so rows drift by a few bf16 steps. Measured against the module
# run in float32, our error stays within 1.25x of the bf16 module's own (+1e-3); against the bf16 module, within 3e-2.
GPU_REL_TOL = 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grids", [[[1, 32, 32]] * 4, [[1, 64, 64], [1, 32, 48], [2, 16, 16]]], ids=["4x1024", "mixed"])
@torch.inference_mode()
def test_our_tower_equals_transformers_module_at_the_30b_shape_in_bf16(grids):
    vision_config = transformers_config(released_config("qwen3-vl-30b-a3b")).vision_config
    module = randomized_module(vision_config, "cuda", torch.bfloat16)
    exact = copy.deepcopy(module).float()  # the same bf16 weights, run in float32
    grid = torch.tensor(grids)
    pixels = pixels_for(grids, 1536, "cuda", torch.bfloat16)
    expected = transformers_output(module, pixels, grid)
    exact_out = transformers_output(exact, pixels.float(), grid)
    # every attention (EngineConfig.vision_attention): FP8's is judged against float32 alone, where it must stay
    # within bf16's error (run77: 0.0139 against SDPA's 0.0138 at the 235B shape)
    for gelu_epilogue, attention in [(False, "sdpa"), (True, "sdpa"), (True, "triton"), (True, "triton_fp8")]:
        embeds, stack = VisionTower(module, gelu_epilogue=gelu_epilogue, attention=attention)(pixels, grid)
        for got, want, truth in zip([embeds, *stack], [expected[0], *expected[1]], [exact_out[0], *exact_out[1]]):
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            assert relative_error(got, truth) <= 1.25 * relative_error(want, truth) + 1e-3, attention
            if attention == "triton_fp8":
                continue
            assert relative_error(got, want) < GPU_REL_TOL
            assert torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1).min().item() > 0.999

def test_bench_vision_tiny_cpu_mode_prints_one_json_object_per_run(tmp_path, capsys):
    from lab.bench import vision as bench_vision

    out = tmp_path / "bench.json"
    result = bench_vision.main(["--shape", "tiny", "--reps", "1", "--out", str(out)])
    assert json.loads(capsys.readouterr().out) == result == json.loads(out.read_text())
    assert {"device", "date", "command", "config", "workloads"} <= set(result)
    assert set(result["workloads"]) == {"4x16", "2x64"}
    for figures in result["workloads"].values():
        assert figures["transformers_ms_per_image"] > 0 and figures["ours_ms_per_image"] > 0
        assert figures["ours_error_vs_transformers"] < 1e-5  # float32: the same math as transformers'


def test_bench_vision_sweeps_batch_sizes_and_head_dims(capsys):
    from lab.bench import vision as bench_vision

    result = bench_vision.main(["--shape", "tiny", "--reps", "1", "--batch-sweep", "1,3", "--head-dim-sweep"])
    capsys.readouterr()
    sweep = result["batch_sweep"]
    assert sweep["patches_per_image"] == 64 and set(sweep["ms_per_image"]) == {"1", "3"}
    assert all(ms > 0 for ms in sweep["ms_per_image"].values())
    dims = result["head_dim_sweep"]
    assert set(dims["by_head_dim"]) == {str(d) for d in bench_vision.HEAD_DIMS}
    assert dims["tower_head_dim"] * dims["heads"] == result["config"]["hidden_size"]
    assert all(f["ms"] > 0 and f["useful_tflops"] > 0 for f in dims["by_head_dim"].values())


def test_the_gelu_epilogue_is_refused_for_another_activation(tiny_vision):
    module = copy.deepcopy(tiny_vision)
    module.config.hidden_act = "silu"
    with pytest.raises(ValueError, match="hidden_act is 'silu'"):
        VisionTower(module, gelu_epilogue=True)


class ThreadRanks:
    """n ranks of a tensor-parallel group as threads of this process: all_reduce sums every rank's tensor (in rank
    order, the same sum on each) once all have reached it, as torch.distributed's would."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * size

    def rank(self, rank: int) -> TensorParallel:
        ranks = self

        class Rank(TensorParallel):
            def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
                ranks.parts[self.rank] = x.clone()
                ranks.barrier.wait()
                total = torch.stack(ranks.parts).sum(0)
                ranks.barrier.wait()  # every rank has read the parts before the next all-reduce writes them
                return x.copy_(total)

        return Rank(rank, ranks.size)

    def run(self, fn):
        """fn(rank) on every rank at once, in inference mode; their results in rank order."""
        def body(rank):
            with torch.inference_mode():
                return fn(rank)

        with concurrent.futures.ThreadPoolExecutor(self.size) as pool:
            return list(pool.map(body, range(self.size)))


@pytest.mark.parametrize("spread", [False, True], ids=["whole", "spread-over-steps"])
def test_a_tower_split_over_two_ranks_gives_transformers_output_on_rank_0(tiny_vision, spread):
    """engine.vision_tensor_parallel: each rank holds its half of every block's heads and MLP columns; with the two
    all-reduces a block, rank 0's outputs are the whole module's (a pass run whole, or block by block as the
    engine spreads one over steps); the other rank keeps none."""
    grid = torch.tensor(GRIDS)
    pixels = pixels_for(GRIDS, tiny_vision.patch_embed.proj.weight[0].numel())
    expected, expected_stack = transformers_output(tiny_vision, pixels, grid)
    ranks = ThreadRanks(2)
    towers = [VisionTower(copy.deepcopy(tiny_vision), tp=ranks.rank(r)) for r in range(2)]
    heads = tiny_vision.config.num_heads
    assert [t.num_heads for t in towers] == [heads // 2] * 2
    assert towers[0].module.blocks[0].mlp.linear_fc1.weight.shape[0] == tiny_vision.config.intermediate_size // 2

    def encode(rank):
        tower = towers[rank]
        if not spread:
            return tower(pixels, grid)
        state = tower.begin(pixels, grid)
        while state.next_block < tower.depth:
            tower.run_blocks(state, 1)
        return tower.finish(state)

    (embeds, stack), other = ranks.run(encode)
    assert other is None
    torch.testing.assert_close(embeds, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(stack, expected_stack, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_split_the_ranks_cannot_divide_names_the_vision_config_key(tiny_vision):
    with pytest.raises(CheckpointError, match=r"vision_config.num_heads = 2 is not divisible by tensor_parallel_size 4"):
        shard_vision_blocks(copy.deepcopy(tiny_vision), TensorParallel(0, 4))


def test_bench_vision_tp_runs_two_gloo_ranks_beside_the_whole_tower_and_matches_it(tmp_path, capsys):
    """scripts/bench_vision_tp.py's CPU smoke mode: two processes with the real collectives; the split tower's
    outputs are the whole tower's (float32), and the JSON carries both times."""
    from lab.bench import vision_tp

    out = tmp_path / "tp.json"
    result = vision_tp.main(["--shape", "tiny", "--ranks", "2", "--reps", "1", "--out", str(out)])
    assert json.loads(capsys.readouterr().out) == result == json.loads(out.read_text())
    assert result["ranks"] == 2 and result["patches"] == 64
    assert result["whole_ms"] > 0 and result["split_ms"] > 0 and result["all_reduces_ms"] > 0
    assert result["error_vs_whole"] < 1e-5
