"""lab/kernels/tune_fp8.py turns its MoE sweeps into the ",fp8" rows of a tuned table: the swept steps take the
candidate fastest over both scale layouts, larger steps keep the untuned choice, and the engine reads it back."""

from __future__ import annotations

from lab.kernels import tune_fp8
from workers.model import fused_moe
from workers.model.fused_moe import TileConfig

GATED_FAST = TileConfig(32, 128, 128, 8, 5, 1, 1)
DOWN_FAST = TileConfig(16, 256, 128, 4, 3, 1, 0)


def _rows(times: dict[TileConfig, float], gated: bool) -> dict:
    return {tune_fp8.moe_row_key(gated, cfg): us for cfg, us in times.items()}


def _sweep(channel_gated: dict, block_gated: dict, channel_down: dict, block_down: dict) -> dict:
    return {"channel": {"bf16": 300.0, "fp8_default": 220.0, **_rows(channel_gated, True), **_rows(channel_down, False)},
            "block": {"bf16": 300.0, "fp8_default": 225.0, **_rows(block_gated, True), **_rows(block_down, False)}}


def test_row_keys_name_every_field_of_a_tile_config():
    for gated in (True, False):
        for cfg in tune_fp8.moe_candidates(2048, gated) + tune_fp8.moe_candidates(65536, gated):
            assert tune_fp8._parse_row_key(tune_fp8.moe_row_key(gated, cfg)) == cfg


def test_decode_sized_candidates_stream_weights_in_small_row_tiles_and_gated_tiles_cover_one_scale_block():
    decode = tune_fp8.moe_candidates(256 * 8, True) + tune_fp8.moe_candidates(256 * 8, False)
    assert {c.block_m for c in decode} == {16, 32} and {c.group_m for c in decode} == {1}
    assert {c.block_n for c in tune_fp8.moe_candidates(2048, True)} == {128}
    assert {c.block_k for c in decode} == {fused_moe.FP8_BLOCK_K}
    assert {c.block_m for c in tune_fp8.moe_candidates(16384 * 8, False)} == {64, 128}


def test_table_rows_take_the_fastest_summed_over_layouts_and_keep_the_untuned_tiles_above_the_sweep():
    slow_gated, slow_down = TileConfig(16, 128, 128, 4, 4, 1, 0), TileConfig(16, 64, 128, 4, 4, 1, 0)
    sweeps = {
        # at 64 tokens the channel sweep alone would pick slow_gated; summed with the block layout GATED_FAST wins
        64: _sweep({GATED_FAST: 51.0, slow_gated: 50.0}, {GATED_FAST: 60.0, slow_gated: 70.0},
                   {DOWN_FAST: 30.0, slow_down: 40.0}, {DOWN_FAST: 31.0, slow_down: 41.0}),
        # a candidate that failed (a string) in one layout is not a choice
        256: _sweep({GATED_FAST: 90.0, slow_gated: 95.0}, {GATED_FAST: "OutOfResources: shared memory", slow_gated: 99.0},
                    {DOWN_FAST: 50.0}, {DOWN_FAST: 52.0}),
    }
    rows = tune_fp8.fp8_table_rows(sweeps)
    gated_key, down_key = fused_moe.shape_key(128, 768, 2048, True, True), fused_moe.shape_key(128, 2048, 768, False, True)
    assert set(rows) == {gated_key, down_key}
    assert [pairs for pairs, _ in rows[gated_key]] == [64, 512, 2048, 4096, 16384, tune_fp8.LARGEST_PAIRS]
    assert TileConfig(*rows[gated_key][1][1]) == GATED_FAST
    assert TileConfig(*rows[gated_key][2][1]) == slow_gated
    assert TileConfig(*rows[down_key][2][1]) == DOWN_FAST
    for pairs, cfg in [rows[gated_key][0], *rows[gated_key][3:]]:  # steps not swept: what tile_config chose untuned
        assert TileConfig(*cfg) == fused_moe.tile_config(pairs, True, None, None, True)


def test_a_sweep_of_prefill_steps_alone_leaves_decode_steps_their_untuned_tiles():
    rows = tune_fp8.fp8_table_rows({16384: _sweep({GATED_FAST: 900.0}, {GATED_FAST: 950.0},
                                                  {DOWN_FAST: 800.0}, {DOWN_FAST: 820.0})})
    gated = fused_moe.shape_key(128, 768, 2048, True, True)
    table = {gated: [(pairs, TileConfig(*cfg)) for pairs, cfg in rows[gated]]}

    def pick(pairs: int) -> TileConfig:  # tile_config's lookup: the first row at or above the pair count
        return next(cfg for bound, cfg in table[gated] if bound >= pairs)

    for pairs in (72, 2048, 4096, 10000, 16384):
        assert pick(pairs) == fused_moe.tile_config(pairs, True, None, None, True)
    assert pick(16384 * 8) == GATED_FAST


def test_a_written_table_keeps_the_bf16_rows_and_the_engine_reads_the_fp8_ones_back(monkeypatch, tmp_path):
    sweeps = {64: _sweep({GATED_FAST: 50.0}, {GATED_FAST: 60.0}, {DOWN_FAST: 30.0}, {DOWN_FAST: 31.0})}
    bf16_key = fused_moe.shape_key(128, 768, 2048, True)
    bf16_rows = {bf16_key: [(512, TileConfig(16, 128, 128, 4, 3, 0, 0))]}
    table = fused_moe.merged_table(bf16_rows, tune_fp8.fp8_table_rows(sweeps))
    (tmp_path / "Some_GPU.json").write_text(fused_moe.table_text(table))
    monkeypatch.setattr(fused_moe, "TUNED_DIR", tmp_path)
    fused_moe._tuned.cache_clear()
    try:
        keys = fused_moe.shape_key(128, 768, 2048, True, True), fused_moe.shape_key(128, 2048, 768, False, True)
        decode = [fused_moe.tile_config(pairs, g, k, "Some GPU", True) for pairs in (80, 512) for g, k in zip((True, False), keys)]
        prefill = [fused_moe.tile_config(65536, g, k, "Some GPU", True) for g, k in zip((True, False), keys)]
        bf16 = fused_moe.tile_config(512, True, bf16_key, "Some GPU")
    finally:
        fused_moe._tuned.cache_clear()
    assert decode == [GATED_FAST, DOWN_FAST] * 2
    assert prefill == [fused_moe.tile_config(65536, g, None, None, True) for g in (True, False)]
    assert bf16 == TileConfig(16, 128, 128, 4, 3, 0, 0)
