"""The vision tower's attention (workers/model/vision_attention.py): our Triton kernel computes softmax(q k^T) v
within each frame, as SDPA does, for every frame of a call in one launch; its FP8 variant stays within FP8's
rounding; the tower runs whichever EngineConfig.vision_attention names (Triton's interpreter on CPU with
TRITON_INTERPRET=1; the tower's real shapes on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from workers.model import vision_attention as va
from workers.model import vision_attention_gluon_fp8 as fp8_gluon
from workers.model import vision_fp8_operands as fp8_operands
from workers.model.vision_attention_gluon import GluonConfig, check_shapes, takes

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and va.triton is not None
ON_INTERPRETER = pytest.mark.skipif(not INTERPRETER, reason="needs triton and TRITON_INTERPRET=1")
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or va.triton is None,
                                               reason="needs CUDA and triton")]
SMALL = va.KernelConfig(16, 16, 4, 1)  # K and V tiles through tensor descriptors
SMALL_POINTERS = va.KernelConfig(16, 16, 4, 1, tma=False)
SMALL_FP8 = va.KernelConfig(16, 32, 4, 1, tma=False)  # FP8's k-step is 32
SMALL_FP8_DESCRIPTORS = va.KernelConfig(16, 32, 4, 1)
SMALL_LAZY = va.KernelConfig(16, 16, 4, 1, lazy_rescale=True)
SMALL_HALF_EXP = va.KernelConfig(16, 16, 4, 1, half_exp=True)
SMALL_FP8_LAZY = va.KernelConfig(16, 32, 4, 1, lazy_rescale=True)
# frames of unequal sizes, none a multiple of the tiles: the tail tiles and the frame edges are masked
RUNS = [(37, 2), (20, 1), (5, 1)]


def draw(frames, heads, dim, device, dtype, seed=0):
    """q, k [N, heads, dim] and v, a strided view of a fused qkv, as the tower hands them over."""
    n = sum(length * count for length, count in frames)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(n, heads, dim, generator=g, device=device).to(dtype) for _ in range(2))
    v = torch.randn(n, 3, heads, dim, generator=g, device=device).to(dtype)[:, 2]
    return q, k, v


def relative_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def exact(q, k, v, frames):
    return va.attention_reference(q.double(), k.double(), v.double(), frames, q.shape[-1] ** -0.5)


def test_block_table_covers_every_query_row_once_largest_frame_first():
    table = va.block_table([(5, 1), (40, 2), (3, 1)], 16, torch.device("cpu")).tolist()
    # frames: [0, 5), [5, 45), [45, 85), [85, 88); the two 40-row frames first, then 5, then 3; each frame's keys
    # from a multiple of 16 in the aligned layout: 0, 16, 64, 112
    assert table == [[5, 5, 45, 16], [21, 5, 45, 16], [37, 5, 45, 16], [45, 45, 85, 64], [61, 45, 85, 64],
                     [77, 45, 85, 64], [0, 0, 5, 0], [85, 85, 88, 112]]
    covered = sorted(r for q, start, end, _ in table for r in range(q, min(q + 16, end)))
    assert covered == list(range(88))


def test_rows_that_a_tensor_descriptor_cannot_address_take_the_pointer_kernel():
    aligned = torch.zeros(8, 16, 72, dtype=torch.bfloat16)
    assert va._rows_fit_descriptors(aligned, aligned[:, :, :], torch.zeros(8, 3, 16, 72, dtype=torch.bfloat16)[:, 2])
    # one byte per element: head h starts at byte 72 h, not 16-byte aligned for odd h
    assert not va._rows_fit_descriptors(aligned.to(torch.float8_e4m3fn))
    assert not va._rows_fit_descriptors(torch.zeros(8, 16, 80)[:, :, :72])  # heads not packed


def test_head_dim_splits_into_a_power_of_two_and_a_masked_tail():
    if va.triton is None:
        pytest.skip("needs triton")
    assert va.head_split(72, 16) == (64, 16)  # the tower: 64 + 8 of 16
    assert va.head_split(72, 32) == (64, 32)  # FP8: the tail at FP8's k-step
    assert va.head_split(64, 16) == (64, 0)
    assert va.head_split(24, 16) == (16, 16)


def test_unknown_implementation_is_refused_by_name():
    q, k, v = draw([(4, 1)], 1, 16, "cpu", torch.float32)
    with pytest.raises(ValueError, match="'flash3'"):
        va.vision_attention(q, k, v, va.AttentionPlan([(4, 1)]), 0.25, "flash3")


def test_a_plan_for_other_frames_is_refused():
    q, k, v = draw([(4, 1)], 1, 16, "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="planned for 5 patches, got 4"):
        va.vision_attention(q, k, v, va.AttentionPlan([(5, 1)]), 0.25, "triton")


@pytest.mark.skipif(INTERPRETER, reason="checks the CPU fallback, which the interpreter replaces")
def test_on_the_cpu_every_implementation_runs_sdpa():
    q, k, v = draw(RUNS, 2, 24, "cpu", torch.float32)
    plan = va.AttentionPlan(RUNS)
    want = va.attention_reference(q, k, v, RUNS, 0.2)
    for impl in va.IMPLEMENTATIONS:
        assert torch.equal(va.vision_attention(q, k, v, plan, 0.2, impl), want)


@ON_INTERPRETER
@pytest.mark.parametrize("config", [SMALL, SMALL_POINTERS, SMALL_LAZY], ids=["descriptors", "pointers", "lazy"])
@pytest.mark.parametrize("dim", [72, 24, 64])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_kernel_is_attention_within_each_frame(dim, dtype, bound, config):
    # (the interpreter's bf16 dot is not bf16 arithmetic; bf16 runs on CUDA below)
    q, k, v = draw(RUNS, 2, dim, "cpu", dtype, seed=dim)
    got = va.attention_triton(q, k, v, va.AttentionPlan(RUNS), dim**-0.5, config)
    assert got.shape == (q.shape[0], 2 * dim) and got.dtype == dtype
    assert relative_error(got, exact(q, k, v, RUNS)) < bound


@ON_INTERPRETER
@pytest.mark.parametrize("dim", [72, 24, 64])
def test_half_exp_kernel_is_attention_within_fp16_rounding(dim):
    # exponentials of f16-rounded scores, P and V in fp16, each row's sum of P from V's ones column
    q, k, v = draw(RUNS, 2, dim, "cpu", torch.float16, seed=dim + 1)
    want = exact(q, k, v, RUNS)
    got = va.attention_triton(q, k, v, va.AttentionPlan(RUNS), dim**-0.5, SMALL_HALF_EXP)
    assert got.shape == (q.shape[0], 2 * dim) and got.dtype == torch.float16
    assert relative_error(got, want) < 3e-3
    # without the ones column's row sums the outputs would be off by the rows' sums of P: far beyond rounding
    assert relative_error(got, va.attention_triton(q, k, v, va.AttentionPlan(RUNS), dim**-0.5, SMALL)) < 3e-3


def test_half_exp_values_carry_a_ones_column_for_the_row_sums():
    v = torch.tensor([[[1.5, -2.0, 70000.0]], [[0.25, 3.0, -1e6]]], dtype=torch.bfloat16)  # [2, 1 head, 3]
    out = va.values_with_ones(v, 8)
    assert out.dtype == torch.float16 and out.shape == (2, 1, 8)
    # values as they were, but clamped inside fp16's range; ones at head_dim; zeros after
    assert out[:, 0, :3].tolist() == [[1.5, -2.0, 65280.0], [0.25, 3.0, -65280.0]]
    assert out[:, 0, 3].tolist() == [1.0, 1.0] and not out[:, 0, 4:].any()
    with pytest.raises(ValueError, match="no column for the row sums"):
        va.values_with_ones(v, 3)


def test_the_values_with_ones_of_cpu_tensors_are_the_torch_references():
    v = draw([(9, 1)], 2, 5, "cpu", torch.bfloat16, seed=2)[2]
    assert torch.equal(va.values_with_ones(v, 8), va.values_with_ones_reference(v, 8))


@ON_INTERPRETER
@pytest.mark.parametrize("dim, width", [(5, 8), (72, 80)])
def test_the_values_with_ones_kernel_writes_the_torch_references_bits(dim, width):
    """One launch in place of four torch ops, bit for bit: v read through the fused projection's strides, clamped
    into fp16's range, rounded to nearest even, the ones column and the zeros after it."""
    _, _, v = draw([(37, 1), (20, 1)], 3, dim, "cpu", torch.bfloat16, seed=4)
    v.mul_(torch.tensor(10.0, dtype=torch.bfloat16) ** torch.randint(-9, 6, v.shape))  # fp16's subnormals to past its range
    v[0, 0, 0], v[1, 2, 1] = float("nan"), float("-inf")
    got = va.values_with_ones(v, width)
    want = va.values_with_ones_reference(v, width)
    assert v.stride(0) == 3 * 3 * dim and got.is_contiguous()  # v: a view of the fused projection's rows
    nan = want.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)  # a NaN stays one (its sign and payload are the converter's)
    assert torch.equal(got.masked_fill(nan, 0).view(torch.int16), want.masked_fill(nan, 0).view(torch.int16))


@ON_INTERPRETER
@pytest.mark.parametrize("config", [SMALL_FP8, SMALL_FP8_DESCRIPTORS, SMALL_FP8_LAZY],
                         ids=["pointers", "descriptors", "lazy"])
def test_fp8_kernel_is_attention_within_fp8_rounding(config):
    q, k, v = draw(RUNS, 2, 72, "cpu", torch.float16, seed=3)
    want = exact(q, k, v, RUNS)
    got = va.attention_triton_fp8(q, k, v, va.AttentionPlan(RUNS), 72**-0.5, config)
    error = relative_error(got, want)
    # e4m3 keeps 3 mantissa bits: a few percent on random data, never a wrong frame (that would be ~100%)
    assert 1e-3 < error < 0.1
    # the same inputs rounded to e4m3 and back, through exact attention: our kernel's error is that rounding's
    rounded = [(t8.float() * s[None, :, None]) for t8, s in map(va.quantize_per_head, (q, k, v))]
    assert relative_error(got, exact(*rounded, RUNS)) < 0.05


@ON_INTERPRETER
@pytest.mark.parametrize("attend,config", [(va.attention_triton, SMALL), (va.attention_triton, SMALL_POINTERS),
                                           (va.attention_triton_fp8, SMALL_FP8_DESCRIPTORS),
                                           (va.attention_triton, SMALL_HALF_EXP)],
                         ids=["descriptors", "pointers", "fp8-descriptors", "half-exp"])
def test_a_frame_attends_only_to_itself(attend, config):
    q, k, v = draw([(20, 1), (20, 1)], 2, 72, "cpu", torch.float32, seed=4)
    plan = va.AttentionPlan([(20, 1), (20, 1)])
    v[20:] *= 0.25  # (FP8: the second frame sets nothing of the per-head scales, before and after the change)
    base = attend(q, k, v, plan, 0.1, config)
    v2 = v.clone()
    v2[20:] += 0.5  # the second frame's values change; the first frame's outputs must not
    moved = attend(q, k, v2, plan, 0.1, config)
    assert torch.equal(base[:20], moved[:20]) and not torch.allclose(base[20:], moved[20:])


@ON_INTERPRETER
@pytest.mark.parametrize("attend,config,bound", [(va.attention_triton, SMALL_LAZY, 1e-5),
                                                 (va.attention_triton_fp8, SMALL_FP8_LAZY, 0.1)], ids=["bf16", "fp8"])
def test_lazy_rescaling_is_softmax_while_a_rows_maximum_keeps_growing(attend, config, bound):
    # scores that grow along the keys, by far more than 2^8 over the frame: every row's reference goes stale, moves,
    # and goes stale again; the probabilities of the stale stretches reach up to 2^8 before the reference moves
    q, k, v = draw([(150, 1)], 2, 72, "cpu", torch.float32, seed=6)
    q = q.abs() + 0.5
    k = k.abs() * torch.linspace(0.1, 3.0, 150)[:, None, None]
    got = attend(q, k, v, va.AttentionPlan([(150, 1)]), 72**-0.5, config)
    assert not got.isnan().any()
    assert relative_error(got, exact(q, k, v, [(150, 1)])) < bound


@ON_INTERPRETER
def test_auto_runs_our_kernel_for_a_call_with_a_large_frame_and_sdpa_otherwise(monkeypatch):
    q, k, v = draw(RUNS, 2, 72, "cpu", torch.float32, seed=8)  # largest frame: 37 patches
    plan = va.AttentionPlan(RUNS)
    ours = va.attention_triton(q, k, v, plan, 0.1)
    theirs = va.attention_reference(q, k, v, RUNS, 0.1)
    assert not torch.equal(ours, theirs)
    monkeypatch.setattr(va, "AUTO_KERNEL_FROM_PATCHES", 37)
    assert torch.equal(va.vision_attention(q, k, v, plan, 0.1, "auto"), ours)  # no sm_90 here: Triton's kernel
    monkeypatch.setattr(va, "AUTO_KERNEL_FROM_PATCHES", 38)
    assert torch.equal(va.vision_attention(q, k, v, plan, 0.1, "auto"), theirs)


def test_auto_takes_our_kernel_for_a_large_frame_or_a_large_call_over_frames_of_several_sizes(monkeypatch):
    """SDPA takes a call a run of equal frames and a concatenation, our kernel one launch over every frame: a call
    over several runs goes to ours once it is large enough and has a frame long enough for our tiles."""
    monkeypatch.setattr(va, "AUTO_KERNEL_FROM_PATCHES", 1000)
    monkeypatch.setattr(va, "AUTO_MIXED_FROM_PATCHES", 99)
    monkeypatch.setattr(va, "AUTO_MIXED_LARGEST_FROM", 37)
    assert va.call_kernel("auto", va.AttentionPlan(RUNS)) == "gluon"  # 99 patches in three runs, the largest 37
    assert va.call_kernel("auto", va.AttentionPlan(RUNS), gluon=False) == "sdpa"  # measured with the Gluon kernel
    assert va.call_kernel("auto", va.AttentionPlan([(37, 2), (20, 1)])) == "sdpa"  # 94 patches in all
    assert va.call_kernel("auto", va.AttentionPlan([(33, 3)])) == "sdpa"  # 99 patches, one run: one SDPA call
    monkeypatch.setattr(va, "AUTO_MIXED_LARGEST_FROM", 38)
    assert va.call_kernel("auto", va.AttentionPlan(RUNS)) == "sdpa"  # no frame long enough
    monkeypatch.setattr(va, "AUTO_KERNEL_FROM_PATCHES", 33)
    assert va.call_kernel("auto", va.AttentionPlan([(33, 3)])) == "gluon"  # one run of large frames


def test_fp8_descriptor_operands_are_padded_and_transposed_for_aligned_tiles():
    q, k, v = draw([(5, 1), (20, 1)], 2, 72, "cpu", torch.float32, seed=5)
    q8, k8, vt, qk_scale, v_scale = va.quantize_for_descriptors(q, k, v, va.AttentionPlan([(5, 1), (20, 1)]), 96)
    assert q8.shape == k8.shape == (25, 2, 96) and vt.shape == (144, 48)  # frames from columns 0 and 16, to 48
    assert q8.dtype == vt.dtype == torch.float8_e4m3fn
    assert not q8[:, :, 72:].float().any() and not vt[:, 5:16].float().any() and not vt[:, 36:].float().any()
    keys = torch.cat([vt[:, :5], vt[:, 16:36]], dim=1)
    back = keys.float().reshape(2, 72, 25).permute(2, 0, 1) * v_scale[None, :, None]
    assert relative_error(back, v) < 0.05 and qk_scale.shape == (2,)


def test_fp8_gluon_operands_carry_a_ones_row_that_sums_p():
    plan = va.AttentionPlan([(5, 1), (20, 1)])
    q, k, v = draw(plan.runs, 2, 72, "cpu", torch.float32, seed=6)
    q8, k8, vt, qk_scale, v_scale = va.quantize_for_descriptors(q, k, v, plan, 96, 80)
    assert q8.shape == k8.shape == (25, 2, 96) and vt.shape == (160, 48)  # 80 rows a head, keys as before
    rows = vt.float().reshape(2, 80, 48)
    assert torch.equal(rows[:, 72], torch.ones(2, 48)) and not rows[:, 73:].any()  # the ones row, then zeros
    keys = torch.cat([rows[:, :72, :5], rows[:, :72, 16:36]], dim=2)
    assert relative_error(keys.permute(2, 0, 1) * v_scale[None, :, None], v) < 0.05
    assert not rows[:, :72, 5:16].any() and not rows[:, :72, 36:].any()  # the gaps between frames: zeros


@ON_INTERPRETER
@pytest.mark.parametrize("padded", [72, 96])
def test_the_fp8_operand_kernels_lay_out_what_torch_does(monkeypatch, padded):
    plan = va.AttentionPlan(RUNS)
    # values e4m3 holds exactly (the interpreter's own e4m3 rounding is not the GPU's), each head's amax 448 x scale
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 256, (plan.patches, 3, 2, 72), generator=g, dtype=torch.uint8)
    exact8 = codes.view(torch.float8_e4m3fn).float().nan_to_num(0.0)
    exact8[0, :, :, 0] = 448.0
    q, k, v = (exact8 * torch.tensor([0.5, 3.0])[None, None, :, None]).unbind(1)  # v: a strided view, as the tower's
    scale = fp8_operands.head_scales(q)
    assert scale.tolist() == [0.5, 3.0]
    columns = plan.key_columns(torch.device("cpu"))
    results = {}
    for triton_runs in (False, True):
        monkeypatch.setattr(fp8_operands, "_triton_runs", lambda x, runs=triton_runs: runs)
        vt = torch.zeros(2, 80, plan.key_width, dtype=torch.float8_e4m3fn)
        fp8_operands.quantize_transposed(v, scale, columns, vt)
        results[triton_runs] = (fp8_operands.quantize_rows(q, scale, padded).view(torch.uint8), vt.view(torch.uint8))
    assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])
    assert results[True][1].any() and not results[True][1][:, 72:].any()  # rows past head_dim left as they were


def fp8_gluon_scheme(q, k, v, plan: va.AttentionPlan, scale: float) -> torch.Tensor:
    """What the FP8 Gluon kernel computes from its operands, in float64 on the CPU: the scores of e4m3 q and k,
    P = 2^8 exp(scores - row max) rounded to e4m3, P @ V^T's rows over each frame's key columns, divided by P @ the
    ones row, times V's scale."""
    q8, k8, vt, qk_scale, v_scale = va.quantize_for_descriptors(q, k, v, plan, 96, 80)
    heads, dim = q.shape[1], q.shape[2]
    rows = vt.double().reshape(heads, 80, plan.key_width)
    out = torch.empty(q.shape[0], heads, dim, dtype=torch.float64)
    for (start, end), key_col in zip(va.frame_bounds(plan.runs), va.aligned_starts(va.frame_bounds(plan.runs))[0]):
        scores = torch.einsum("qhd,khd->hqk", q8[start:end].double(), k8[start:end].double())
        scores = scores * (scale * qk_scale.double())[:, None, None]
        p = (256 * torch.exp(scores - scores.amax(-1, keepdim=True))).to(torch.float8_e4m3fn).double()
        keys = rows[:, :, key_col:key_col + end - start]
        sums = torch.einsum("hqk,hvk->qhv", p, keys)
        out[start:end] = sums[:, :, :dim] / sums[:, :, dim:dim + 1] * v_scale.double()[None, :, None]
    return out.reshape(q.shape[0], heads * dim)


def test_the_fp8_gluon_kernels_operands_hold_attention_within_each_frame():
    plan = va.AttentionPlan(RUNS)
    q, k, v = draw(RUNS, 2, 72, "cpu", torch.float32, seed=7)
    got = fp8_gluon_scheme(q, k, v, plan, 72**-0.5)
    assert relative_error(got, exact(q, k, v, RUNS)) < 0.05


def test_the_fp8_gluon_kernel_refuses_operands_it_was_not_written_for():
    qk = torch.zeros(8, 2, 96, dtype=torch.float8_e4m3fn)
    vt = torch.zeros(160, 16, dtype=torch.float8_e4m3fn)
    assert fp8_gluon.check_operands(qk, qk, vt, 72) == (8, 2)
    with pytest.raises(ValueError, match="head_dim"):
        fp8_gluon.check_operands(qk, qk, vt, 64)
    with pytest.raises(ValueError, match=r"\[N, heads, 96\]"):
        fp8_gluon.check_operands(torch.zeros(8, 2, 72, dtype=torch.float8_e4m3fn), qk, vt, 72)
    with pytest.raises(ValueError, match="vt must be"):
        fp8_gluon.check_operands(qk, qk, torch.zeros(144, 16, dtype=torch.float8_e4m3fn), 72)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_gluon.check_operands(qk, qk, vt.to(torch.bfloat16), 72)


@pytest.mark.parametrize("patches", [4096, 16384])
@pytest.mark.parametrize("config", [fp8_gluon.DEFAULT_GLUON_FP8_CONFIG, fp8_gluon.GluonFp8Config(128, 64, 8, 2),
                                    fp8_gluon.GluonFp8Config(64, 64, 4, 2)],
                         ids=["default", "m128w8-uncapped", "m64w4"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_fp8_gluon_kernel_is_attention_within_each_frame_on_hopper(device, patches, config):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90")
    frames = [(patches + 37, 1), (1000, 3), (50, 1)]  # frames ending mid-tile, one shorter than a tile
    q, k, v = draw(frames, 16, 72, device, torch.bfloat16, seed=patches + 5)
    got = va.vision_attention(q, k, v, va.AttentionPlan(frames), 72**-0.5, "gluon_fp8", config)
    want = va.attention_reference(q.float(), k.float(), v.float(), frames, 72**-0.5)
    assert not got.isnan().any()
    assert relative_error(got, want) < 8e-2


@pytest.mark.parametrize("patches", [4096, 16384])
@pytest.mark.parametrize("impl,config,bound", [
    ("triton", None, 1e-2), ("triton", va.KernelConfig(128, 64, 4, 3, warp_specialize=True), 1e-2),
    ("triton_fp8", None, 8e-2), ("triton_fp8", va.KernelConfig(128, 128, 8, 3), 8e-2),
    ("triton_fp8", va.KernelConfig(128, 64, 4, 3), 8e-2),
    ("triton", va.KernelConfig(128, 64, 4, 3, lazy_rescale=True), 1e-2),
    ("triton_fp8", va.KernelConfig(128, 64, 4, 3, lazy_rescale=True), 8e-2),
    ("triton", va.KernelConfig(128, 64, 4, 3, half_exp=True), 1e-2),
    ("triton", va.KernelConfig(128, 128, 8, 3, half_exp=True), 1e-2)],
    ids=["bf16", "bf16-ws", "fp8", "fp8-tma-8w", "fp8-tma-4w", "bf16-lazy", "fp8-lazy", "bf16-half-exp",
         "bf16-half-exp-8w"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_kernels_at_the_towers_shapes_on_cuda(device, patches, impl, config, bound):
    frames = [(patches + 37, 1), (1000, 3)]  # frames ending mid-tile, one at the end of the tensor
    q, k, v = draw(frames, 16, 72, device, torch.bfloat16, seed=patches)
    got = va.vision_attention(q, k, v, va.AttentionPlan(frames), 72**-0.5, impl, config)
    want = va.attention_reference(q.float(), k.float(), v.float(), frames, 72**-0.5)
    assert not got.isnan().any()
    assert relative_error(got, want) < bound


@pytest.mark.parametrize("patches", [4096, 16384])
@pytest.mark.parametrize("config", [GluonConfig(128, 64, 4, 2), GluonConfig(64, 64, 4, 3), GluonConfig(128, 64, 8, 2),
                                    GluonConfig(128, 128, 8, 2)], ids=["m128w4s2", "m64w4s3", "m128w8s2", "n128w8s2"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_gluon_kernel_is_attention_within_each_frame_on_hopper(device, patches, config):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for sm_90")
    # frames ending mid-tile, one shorter than a tile, the last at the end of the tensor
    frames = [(patches + 37, 1), (1000, 3), (50, 1)]
    q, k, v = draw(frames, 16, 72, device, torch.bfloat16, seed=patches + 3)
    got = va.vision_attention(q, k, v, va.AttentionPlan(frames), 72**-0.5, "gluon", config)
    want = va.attention_reference(q.float(), k.float(), v.float(), frames, 72**-0.5)
    assert not got.isnan().any()
    assert relative_error(got, want) < 1e-2


def test_the_warm_up_compiles_the_kernel_that_large_frames_take():
    assert va.large_frame_kernel("auto") == "gluon" and va.large_frame_kernel("triton_fp8") == "triton_fp8"
    assert va.large_frame_kernel("gluon_fp8") == "gluon_fp8"
    # nothing to compile for SDPA, nor off CUDA
    assert va.warm_up_kernel("sdpa", 16, 72, torch.device("cuda"), torch.bfloat16) == "none"
    assert va.warm_up_kernel("auto", 16, 72, torch.device("cpu"), torch.bfloat16) == "none"


@pytest.mark.parametrize("impl", ["auto", "triton", "gluon_fp8"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_the_warm_up_runs_the_large_frame_kernel_on_cuda(device, impl):
    expected = va.large_frame_kernel(impl)
    assert va.warm_up_kernel(impl, 16, 72, torch.device(device), torch.bfloat16) == expected


def test_a_plan_lists_each_frames_first_row_for_varlen_kernels():
    assert va.AttentionPlan(RUNS).cu_lengths(torch.device("cpu")).tolist() == [0, 37, 74, 94, 99]
    assert va.AttentionPlan(RUNS).cu_lengths(torch.device("cpu")).dtype == torch.int32


def test_flash_attn4_takes_calls_with_a_large_frame_and_leaves_the_rest_to_sdpa(monkeypatch):
    monkeypatch.setattr(va, "FA4_FROM_PATCHES", 37)
    assert va.call_kernel("flash_attn4", va.AttentionPlan(RUNS)) == "flash_attn4"  # largest frame: 37 patches
    monkeypatch.setattr(va, "FA4_FROM_PATCHES", 38)
    assert va.call_kernel("flash_attn4", va.AttentionPlan(RUNS)) == "sdpa"
    assert va.call_kernel("gluon", va.AttentionPlan(RUNS)) == "gluon"  # a named kernel runs at every size


def test_flash_attn4_without_its_package_stops_the_warm_up_naming_key_and_package(monkeypatch):
    from workers.model import vision_attention_fa4 as fa4

    monkeypatch.setattr(fa4.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="engine.vision_attention 'flash_attn4' needs the flash-attn-4 package"):
        va.warm_up_kernel("flash_attn4", 16, 72, torch.device("cuda"), torch.bfloat16)
    assert va.warm_up_kernel("flash_attn4", 16, 72, torch.device("cpu"), torch.bfloat16) == "none"
    monkeypatch.setitem(__import__("sys").modules, "flash_attn.cute", None)  # its import fails
    q, k, v = draw([(4, 1)], 1, 16, "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="needs the flash-attn-4 package"):  # called without a warm-up too
        fa4.attention_fa4(q, k, v, va.AttentionPlan([(4, 1)]).cu_lengths(q.device), 4, 0.25)


def test_flash_attn4_is_one_varlen_call_over_the_plans_frames(monkeypatch):
    """FlashAttention-4's entry point gets every frame in one call: cumulative lengths, the largest frame, the
    scale; its [N, heads, dim] output comes back as the tower's [N, heads * dim] rows."""
    import sys
    import types

    from workers.model import vision_attention_fa4 as fa4

    calls = []

    def flash_attn_varlen_func(q, k, v, **kwargs):
        calls.append(kwargs)
        return va.attention_reference(q, k, v, RUNS, kwargs["softmax_scale"]).view(q.shape), None

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    q, k, v = draw(RUNS, 2, 24, "cpu", torch.float32)
    plan = va.AttentionPlan(RUNS)
    got = fa4.attention_fa4(q, k, v, plan.cu_lengths(q.device), plan.largest_frame, 0.2)
    assert torch.equal(got, va.attention_reference(q, k, v, RUNS, 0.2))
    assert len(calls) == 1
    assert calls[0]["cu_seqlens_q"].tolist() == calls[0]["cu_seqlens_k"].tolist() == [0, 37, 74, 94, 99]
    assert calls[0]["max_seqlen_q"] == calls[0]["max_seqlen_k"] == 37 and calls[0]["softmax_scale"] == 0.2


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_flash_attn4_is_attention_within_each_frame_on_cuda(device):
    from workers.model import vision_attention_fa4 as fa4

    if not fa4.installed():
        pytest.skip("needs the optional flash-attn-4 package")
    frames = [(16384 + 37, 1), (1000, 3), (50, 1)]  # frames ending mid-tile, one shorter than a tile
    q, k, v = draw(frames, 16, 72, device, torch.bfloat16, seed=5)
    got = va.vision_attention(q, k, v, va.AttentionPlan(frames), 72**-0.5, "flash_attn4")
    want = va.attention_reference(q.float(), k.float(), v.float(), frames, 72**-0.5)
    assert not got.isnan().any()
    assert relative_error(got, want) < 1e-2
    assert va.warm_up_kernel("flash_attn4", 16, 72, torch.device(device), torch.bfloat16) == "flash_attn4"


def test_the_gluon_kernel_refuses_shapes_it_was_not_written_for():
    q = torch.zeros(8, 2, 72, dtype=torch.bfloat16)
    check_shapes(q, q, q)
    with pytest.raises(ValueError, match="head_dim"):
        check_shapes(*(torch.zeros(8, 2, 64, dtype=torch.bfloat16),) * 3)
    with pytest.raises(ValueError, match="bf16"):
        check_shapes(*(torch.zeros(8, 2, 72, dtype=torch.float16),) * 3)
    with pytest.raises(ValueError, match="rows"):
        strided = torch.zeros(8, 2, 80, dtype=torch.bfloat16)[:, :, :72]
        check_shapes(strided, q, q)
    # where it refuses, "gluon" runs Triton's kernel instead (an fp16 engine, say)
    assert takes(q, q, q) and not takes(*(torch.zeros(8, 2, 72, dtype=torch.float16),) * 3)


def test_the_engine_runs_the_tower_with_the_configured_attention(tiny_moe_checkpoint):
    from tests.helpers.engine_equivalence import make_engine

    engine = make_engine(tiny_moe_checkpoint, vision_attention="triton_fp8")
    assert engine.executor.vision.tower.attention == "triton_fp8"
    assert make_engine(tiny_moe_checkpoint).executor.vision.tower.attention == "auto"  # the default


def test_an_unknown_vision_attention_is_refused_by_its_key(tiny_moe_checkpoint):
    from pydantic import ValidationError

    from workers.config import EngineConfig

    with pytest.raises(ValidationError, match="vision_attention"):
        EngineConfig(checkpoint=tiny_moe_checkpoint, vision_attention="flash3")


def test_the_bench_reads_tile_shapes_and_picks_the_fastest_at_the_largest_size():
    from lab.bench import vision_attention as bench

    configs = bench.parse_configs("128:64:4:3,64:64:4:2:0,128:128:8:3:1:1,128:64:4:3:1:0:0:1")
    assert configs == [va.KernelConfig(128, 64, 4, 3, tma=True), va.KernelConfig(64, 64, 4, 2, tma=False),
                       va.KernelConfig(128, 128, 8, 3, tma=True, warp_specialize=True),
                       va.KernelConfig(128, 64, 4, 3, half_exp=True)]
    names = [bench.config_name("triton", c) for c in configs]
    assert names == ["triton[m128n64w4s3tma]", "triton[m64n64w4s2ptr]", "triton[m128n128w8s3tmaws]",
                     "triton[m128n64w4s3tmahe]"]
    configs, names = configs[:2], names[:2]
    kernels = {"4096": {names[0]: {"attention_tflops": 1.0}, names[1]: {"attention_tflops": 9.0}},
               "62500": {names[0]: {"attention_tflops": 5.0}, names[1]: {"error": "OutOfResources"}}}
    assert bench.best_config(kernels, "triton", configs) == configs[0]  # 62,500 decides; a failed shape never wins


def test_the_bench_never_hands_the_tower_a_kernel_that_is_not_attention():
    from lab.bench import vision_attention as bench

    configs = bench.parse_gluon_fp8_configs("128:64:8:2:128,64:64:4:2")
    assert configs == [fp8_gluon.GluonFp8Config(128, 64, 8, 2, 128), fp8_gluon.GluonFp8Config(64, 64, 4, 2)]
    names = [bench.gluon_fp8_name(c) for c in configs]
    assert names == ["gluon_fp8[m128n64w8s2r128]", "gluon_fp8[m64n64w4s2]"]
    # run144: the faster variant's sums had stopped growing (error 1.09 against float32)
    kernels = {"62500": {names[0]: {"attention_tflops": 399.8, "error_vs_fp32": 0.0546},
                         names[1]: {"attention_tflops": 457.6, "error_vs_fp32": 1.09}}}
    assert bench.best_config(kernels, "gluon_fp8", configs) == configs[0]
