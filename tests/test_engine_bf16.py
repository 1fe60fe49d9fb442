"""In bfloat16 on CPU the engine (its torch reference paths: the vision tower's fused-kernel references, paged
attention, the MoE) generates what transformers generates in bfloat16; a token may differ only after a near-tie
of transformers' own top-2 logits. The CUDA twin is tests/test_engine_gpu.py."""

from __future__ import annotations

import pytest

from bf16_reference import MAX_PIXELS, MIN_PIXELS, bf16_cases, bf16_reference, run_engine_and_compare
from workers.config import EngineConfig
from workers.engine import LLMEngine


@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_engine_matches_transformers_in_bfloat16_on_cpu(request, arch):
    checkpoint = request.getfixturevalue(f"tiny_{arch}_checkpoint")
    cases = bf16_cases(bf16_reference(checkpoint, "cpu"))
    engine = LLMEngine(EngineConfig(
        checkpoint=checkpoint, device="cpu", dtype="bfloat16", num_kv_blocks=256, block_size=16, max_model_len=1024,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_num_seqs=8,
    ))
    run_engine_and_compare(engine, cases)
