"""The Triton paged attention kernels (multi-row chunks, split decode) compute what per-sequence SDPA computes.

On the CPU they run in Triton's interpreter (TRITON_INTERPRET=1 with triton importable; skipped otherwise);
the tests marked gpu compare them in bfloat16 at the Qwen3-VL-30B-A3B shape on CUDA. With an FP8 cache both
read what float32 SDPA over the dequantized cache reads.
"""

from __future__ import annotations

import os

import pytest
import torch

from lab.bench.paged_attention_step import paged_step
from workers.kv_cache import FP8_DTYPE, from_cache, quantize_fp8
from workers.model import paged_decode, paged_prefill
from workers.model.attention import paged_attention, sdpa_attention

interpreted = pytest.mark.skipif(
    paged_decode.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton and TRITON_INTERPRET=1 (Triton's CPU interpreter)",
)


def reference(q, k, v, k_cache, v_cache, meta, scale):
    """Per-sequence SDPA in float32."""
    out = torch.empty_like(q, dtype=torch.float32)
    sdpa_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale, out)
    return out


def fp8_reference(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, fresh_rows_exact):
    """Per-sequence float32 SDPA over an FP8 cache, dequantized. fresh_rows_exact: whole-prompt chunks attend to
    the step's own k/v (the TMA path), else to what the cache holds of them (the pointer path)."""
    if not fresh_rows_exact:
        k, v = from_cache(quantize_fp8(k, k_scale), k_scale, q.dtype), from_cache(quantize_fp8(v, v_scale), v_scale, q.dtype)
    out = torch.empty_like(q, dtype=torch.float32)
    sdpa_attention(q.float(), k.float(), v.float(), k_cache, v_cache, meta, scale, out, k_scale, v_scale)
    return out


def as_fp8(k_cache, v_cache, k_scale, v_scale):
    """The caches as an FP8 pool with these scales stores them (the step's rows included)."""
    return quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)


def run_prefill_kernel(q, k_cache, v_cache, meta, scale, out, tiles=paged_prefill.POINTER_TILES, k=None, v=None,
                       k_scale=1.0, v_scale=1.0):
    nd = meta.num_decodes
    paged_prefill.prefill_attention(
        q, k_cache, v_cache, meta.block_tables[nd:], meta.query_starts_device[nd:], meta.context_lens[nd:],
        meta.query_starts[nd], meta.query_starts[-1], scale, out, tiles, k, v, k_scale, v_scale,
    )


# whole-prompt chunks read their K/V from the cache (paged) or from the step's rows through TMA
KV_READS = {"paged": paged_prefill.POINTER_TILES, "fresh-tma": paged_prefill.TMA_TILES}


# Decodes, a first chunk, a later chunk, and a later chunk ending mid-block (block_size 16).
MIXED_STEP = [(1, 40), (1, 3), (37, 37), (20, 53), (9, 25)]


def test_only_steps_with_multi_row_chunks_carry_the_chunk_starts_for_the_prefill_kernel():
    *_, with_chunks = paged_step(MIXED_STEP, 4, 2, 16, 16, torch.float32, "cpu")
    *_, decodes_only = paged_step([(1, 5), (1, 9)], 4, 2, 16, 16, torch.float32, "cpu")
    assert with_chunks.query_starts_device.tolist() == with_chunks.query_starts
    assert with_chunks.query_starts_device.dtype == torch.int32
    assert decodes_only.query_starts_device is None


@pytest.mark.parametrize("batch,expected", [(1, 32), (2, 32), (8, 8), (32, 2), (64, 1), (256, 1)])
def test_decode_splits_the_context_until_every_sm_has_a_program(batch, expected):
    assert paged_decode.num_splits(batch, kv_heads=4, num_sms=132) == expected


@interpreted
@pytest.mark.parametrize("tiles", KV_READS.values(), ids=KV_READS.keys())
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2)], ids=["gqa4", "gqa3-padded"])
def test_prefill_kernel_matches_sdpa_for_first_later_and_mid_block_chunks(heads, kv_heads, tiles):
    q, k, v, k_cache, v_cache, meta = paged_step(MIXED_STEP, heads, kv_heads, 32, 16, torch.float32, "cpu")
    out = torch.full_like(q, float("nan"))
    run_prefill_kernel(q, k_cache, v_cache, meta, 32**-0.5, out, tiles, k, v)
    nd = meta.num_decodes
    torch.testing.assert_close(out[nd:], reference(q, k, v, k_cache, v_cache, meta, 32**-0.5)[nd:], atol=1e-5, rtol=1e-5)
    assert out[:nd].isnan().all()  # decode rows are left to the decode kernel


@interpreted
@pytest.mark.parametrize("tiles", KV_READS.values(), ids=KV_READS.keys())
def test_prefill_kernel_handles_chunks_longer_than_one_tile_after_decodes(tiles):
    step = [(1, 70)] * 3 + [(150, 150), (70, 200)]  # block_m 128 / group 4 = 32 rows per tile
    q, k, v, k_cache, v_cache, meta = paged_step(step, 8, 2, 16, 16, torch.float32, "cpu", seed=1)
    out = torch.empty_like(q)
    run_prefill_kernel(q, k_cache, v_cache, meta, 0.25, out, tiles, k, v)
    torch.testing.assert_close(out[3:], reference(q, k, v, k_cache, v_cache, meta, 0.25)[3:], atol=1e-5, rtol=1e-5)


@interpreted
def test_tma_tiles_without_contiguous_step_rows_read_every_chunk_from_the_cache():
    q, k, v, k_cache, v_cache, meta = paged_step(MIXED_STEP, 8, 2, 32, 16, torch.float32, "cpu", seed=3)
    strided = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k, v)]  # the same rows, not contiguous
    assert not strided[0].is_contiguous()
    out = torch.empty_like(q)
    run_prefill_kernel(q, k_cache, v_cache, meta, 32**-0.5, out, paged_prefill.TMA_TILES, *strided)
    nd = meta.num_decodes
    torch.testing.assert_close(out[nd:], reference(q, k, v, k_cache, v_cache, meta, 32**-0.5)[nd:], atol=1e-5, rtol=1e-5)


def test_default_tiles_read_fresh_rows_through_tma_only_on_cuda_devices_that_have_it(monkeypatch):
    monkeypatch.setattr(paged_prefill, "_has_tma", lambda index: index == 0)
    assert paged_prefill.default_tiles(torch.device("cuda", 0)) == paged_prefill.TMA_TILES
    assert paged_prefill.default_tiles(torch.device("cuda", 0), fp8_cache=True) == paged_prefill.FP8_TMA_TILES
    assert paged_prefill.default_tiles(torch.device("cuda", 1)) == paged_prefill.POINTER_TILES
    assert paged_prefill.default_tiles(torch.device("cpu")) == paged_prefill.POINTER_TILES
    monkeypatch.setattr(paged_prefill, "DEFAULT_TILES", paged_prefill.POINTER_TILES)  # an explicit choice wins
    assert paged_prefill.default_tiles(torch.device("cuda", 0)) == paged_prefill.POINTER_TILES


@interpreted
@pytest.mark.parametrize("splits", [1, 4, 32])
def test_split_decode_matches_sdpa_including_empty_splits(splits):
    step = [(1, 200), (1, 3), (1, 64), (1, 17)]  # short contexts leave most of 32 splits empty
    q, k, v, k_cache, v_cache, meta = paged_step(step, 8, 2, 32, 16, torch.float32, "cpu", seed=2)
    out = torch.empty_like(q)
    paged_decode.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 32**-0.5, out, splits=splits)
    torch.testing.assert_close(out, reference(q, k, v, k_cache, v_cache, meta, 32**-0.5), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_with_a_sequences_kv_heads_in_adjacent_programs_matches_sdpa(splits):
    """The grid's other order (DecodeTiles.heads_adjacent) reads the same rows into the same outputs and partials."""
    step = [(1, 200), (1, 3), (1, 64), (1, 17)]
    q, k, v, k_cache, v_cache, meta = paged_step(step, 8, 2, 32, 16, torch.float32, "cpu", seed=2)
    out = torch.empty_like(q)
    paged_decode.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 32**-0.5, out,
                                  splits=splits, tiles=paged_decode.DecodeTiles(heads_adjacent=True))
    torch.testing.assert_close(out, reference(q, k, v, k_cache, v_cache, meta, 32**-0.5), atol=1e-5, rtol=1e-5)


# Scales that are not powers of two, so a kernel that dropped or misplaced one would be far off.
FP8_SCALES = [(1.0, 1.0), (0.37, 0.053)]


@interpreted
@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize("tiles", KV_READS.values(), ids=KV_READS.keys())
def test_prefill_kernel_over_an_fp8_cache_matches_sdpa_over_the_dequantized_cache(tiles, k_scale, v_scale):
    q, k, v, k_hi, v_hi, meta = paged_step(MIXED_STEP, 8, 2, 32, 16, torch.float32, "cpu", seed=4)
    k, v, k_hi, v_hi = k * k_scale, v * v_scale, k_hi * k_scale, v_hi * v_scale
    k_cache, v_cache = as_fp8(k_hi, v_hi, k_scale, v_scale)
    assert k_cache.dtype == FP8_DTYPE
    out = torch.full_like(q, float("nan"))
    run_prefill_kernel(q, k_cache, v_cache, meta, 32**-0.5, out, tiles, k, v, k_scale, v_scale)
    nd = meta.num_decodes
    expected = fp8_reference(q, k, v, k_cache, v_cache, meta, 32**-0.5, k_scale, v_scale, tiles.fresh_tma)
    torch.testing.assert_close(out[nd:], expected[nd:], atol=1e-5, rtol=1e-5)
    # the FP8 rows are what was read: attention over the float32 cache they came from is measurably apart
    assert (out[nd:] - reference(q, k, v, k_hi, v_hi, meta, 32**-0.5)[nd:]).abs().max() > 1e-3 * v_scale


@interpreted
@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("v_pairs", [True, False], ids=["v_pairs", "v_bytes"])
def test_split_decode_over_an_fp8_cache_matches_sdpa_over_the_dequantized_cache(splits, k_scale, v_scale, v_pairs):
    step = [(1, 200), (1, 3), (1, 64), (1, 17)]
    q, k, v, k_hi, v_hi, meta = paged_step(step, 8, 2, 32, 16, torch.float32, "cpu", seed=5)
    k, v, k_hi, v_hi = k * k_scale, v * v_scale, k_hi * k_scale, v_hi * v_scale
    k_cache, v_cache = as_fp8(k_hi, v_hi, k_scale, v_scale)
    assert paged_decode.v_pairs(v_cache)
    out = torch.empty_like(q)
    paged_decode.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, 32**-0.5, out,
                                  splits=splits, k_scale=k_scale, v_scale=v_scale,
                                  tiles=paged_decode.FP8_DECODE_TILES._replace(v_pairs=v_pairs))
    expected = fp8_reference(q, k, v, k_cache, v_cache, meta, 32**-0.5, k_scale, v_scale, False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out - reference(q, k, v, k_hi, v_hi, meta, 32**-0.5)).abs().max() > 1e-3 * v_scale


def test_fp8_v_tiles_are_read_as_int16_pairs_only_where_every_row_starts_at_an_even_byte():
    storage = torch.zeros(8 * 16 * 2 * 32 + 1, dtype=FP8_DTYPE)
    cache = storage[:-1].view(8, 16, 2, 32)
    assert paged_decode.v_pairs(cache)
    assert not paged_decode.v_pairs(storage[1:].view(8, 16, 2, 32))  # every row one byte on
    assert not paged_decode.v_pairs(cache.to(torch.bfloat16))  # 16-bit rows are widened by no one


def fp8_widening_error(kernel, q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, widen_to=None):
    """The largest gap, in units of v_scale, between a kernel's float32 output (bf16 q over an FP8 cache) and
    float32 attention over the dequantized cache."""
    expected = fp8_reference(q.float(), k.float(), v.float(), k_cache, v_cache, meta, scale, k_scale, v_scale, False)
    out = torch.zeros_like(q, dtype=torch.float32)
    if kernel == "decode":
        paged_decode.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, out,
                                      k_scale=k_scale, v_scale=v_scale, widen_to=widen_to)
    else:
        paged_prefill.prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_starts_device, meta.context_lens, 0,
            meta.query_starts[-1], scale, out, paged_prefill.POINTER_TILES, k_scale=k_scale, v_scale=v_scale,
            widen_to=widen_to,
        )
    return ((out - expected).abs().max() / v_scale).item()


@interpreted
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_bfloat16_queries_over_an_fp8_cache_round_only_the_probabilities_to_float16(kernel):
    # The cache's e4m3 values and bf16 q are float16 values: widened to float16 (the default), the kernels are
    # float32 attention over the dequantized cache but for the probabilities' rounding to 11 bits before the PV
    # product (relative 2^-12). (The interpreter's bfloat16 dot is not numeric, so the bfloat16 widening is
    # compared on CUDA only.)
    k_scale, v_scale = FP8_SCALES[1]
    step = [(1, 200), (1, 37)] if kernel == "decode" else [(20, 53), (9, 25)]
    q, k, v, k_hi, v_hi, meta = paged_step(step, 8, 2, 32, 16, torch.bfloat16, "cpu", seed=6)
    k_cache, v_cache = as_fp8(k_hi.float() * k_scale, v_hi.float() * v_scale, k_scale, v_scale)
    assert paged_decode.FP8_DOT_DTYPE == torch.float16
    error = fp8_widening_error(kernel, q, k, v, k_cache, v_cache, meta, 32**-0.5, k_scale, v_scale)
    assert error < 1e-3


# ---- CUDA, bfloat16, Qwen3-VL-30B-A3B attention shape -----------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
SCALE = HEAD_DIM**-0.5
BF16_ATOL = 2e-2  # bf16 inputs and output, probabilities rounded to bf16 before the PV product


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", KV_READS.values(), ids=KV_READS.keys())
def test_prefill_kernel_matches_sdpa_on_a_catalogue_sized_step_in_bfloat16(monkeypatch, tiles):
    # 8 decodes, then 5 chunks totalling 8,192 rows: a later chunk, full prompts, a 4k-context later chunk.
    monkeypatch.setattr(paged_prefill, "DEFAULT_TILES", tiles)  # what paged_attention (the engine's path) runs
    step = [(1, 1800)] * 8 + [(478, 1734), (1734, 1734), (1734, 1734), (2048, 4096), (2198, 2198)]
    q, k, v, k_cache, v_cache, meta = paged_step(step, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out.float(), reference(q, k, v, k_cache, v_cache, meta, SCALE), atol=BF16_ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("step", [[(1, 1800)], [(1, 1800 + 13 * i) for i in range(64)]], ids=["batch1", "batch64"])
def test_split_decode_matches_sdpa_in_bfloat16(step):
    q, k, v, k_cache, v_cache, meta = paged_step(step, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(out.float(), reference(q, k, v, k_cache, v_cache, meta, SCALE), atol=BF16_ATOL, rtol=0)


FP8_KV_READS = {**KV_READS, "fp8-default": paged_prefill.FP8_TMA_TILES}


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", FP8_KV_READS.values(), ids=FP8_KV_READS.keys())
def test_prefill_kernel_over_an_fp8_cache_matches_sdpa_on_a_catalogue_sized_step(monkeypatch, tiles):
    monkeypatch.setattr(paged_prefill, "DEFAULT_TILES", tiles)
    k_scale, v_scale = FP8_SCALES[1]
    step = [(1, 1800)] * 8 + [(478, 1734), (1734, 1734), (2048, 4096), (2198, 2198)]
    q, k, v, k_cache, v_cache, meta = paged_step(step, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    k_cache, v_cache = as_fp8(k_cache * k_scale, v_cache * v_scale, k_scale, v_scale)
    k, v = (k * k_scale).bfloat16(), (v * v_scale).bfloat16()
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, k_scale, v_scale)
    nd = meta.num_decodes
    expected = fp8_reference(q, k, v, k_cache, v_cache, meta, SCALE, k_scale, v_scale, tiles.fresh_tma)
    # the output is V-sized: v_scale times the bf16 tolerance of the unit-scale tests
    torch.testing.assert_close(out[nd:].float(), expected[nd:], atol=BF16_ATOL * v_scale, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("step", [[(1, 1800)], [(1, 1800 + 13 * i) for i in range(64)]], ids=["batch1", "batch64"])
def test_split_decode_over_an_fp8_cache_matches_sdpa_in_bfloat16(step):
    k_scale, v_scale = FP8_SCALES[1]
    q, k, v, k_cache, v_cache, meta = paged_step(step, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    k_cache, v_cache = as_fp8(k_cache * k_scale, v_cache * v_scale, k_scale, v_scale)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, k_scale, v_scale)
    expected = fp8_reference(q, k, v, k_cache, v_cache, meta, SCALE, k_scale, v_scale, False)
    torch.testing.assert_close(out.float(), expected, atol=BF16_ATOL * v_scale, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_an_fp8_cache_widened_to_float16_is_closer_to_float32_than_widened_to_bfloat16(kernel):
    # the only rounding either widening adds is the probabilities' (11 bits against 8)
    k_scale, v_scale = FP8_SCALES[1]
    step = [(1, 1800 + 13 * i) for i in range(64)] if kernel == "decode" else [(2048, 4096), (478, 1734)]
    q, k, v, k_cache, v_cache, meta = paged_step(step, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    k_cache, v_cache = as_fp8(k_cache.float() * k_scale, v_cache.float() * v_scale, k_scale, v_scale)
    args = (kernel, q, k, v, k_cache, v_cache, meta, SCALE, k_scale, v_scale)
    as_float16, as_bfloat16 = fp8_widening_error(*args), fp8_widening_error(*args, widen_to=torch.bfloat16)
    assert as_float16 < 1e-3
    assert as_float16 * 2 < as_bfloat16
