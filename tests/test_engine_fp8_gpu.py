"""On CUDA the engine's FP8 path (W8A8 GEMMs, FP8 MoE, CUDA graphs) generates what transformers generates with the
same FP8 arithmetic on the same weights, up to a first divergence that float32 transformers with that arithmetic
cannot tell from rounding. transformers cannot load Qwen's per-expert FP8 MoE layout (huggingface/transformers#44230)
and its own FP8 kernels need the `kernels` package, so the reference is transformers on the dequantized copy with the
W8A8 activation rounding emulated around each quantised linear (tests/helpers/fp8_reference.py; on the CPU that
reference gives the engine's W8A8 tokens exactly, tests/test_fp8_checkpoint.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.bf16_reference import (MAX_PIXELS, MIN_PIXELS, TransformersReference, bf16_cases,
                                          run_engine_and_compare)
from tests.helpers.fp8_reference import dequantized_checkpoint, fp8_activation_rounding, quantized_weight_names
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model.fused_moe import SMALL_BATCH_TOKENS
from workers.model.layers import Fp8Linear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["moe", "dense"])
def fp8_checkpoints(request, tmp_path_factory):
    """(the FP8 checkpoint in 128x128 blocks, its dequantized copy for transformers)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workers.quantized_checkpoint import quantize_checkpoint

    src = request.getfixturevalue(f"tiny_{request.param}_checkpoint")
    fp8 = quantize_checkpoint(src, tmp_path_factory.mktemp("fp8-gpu") / request.param)  # 128x128 blocks
    return fp8, dequantized_checkpoint(fp8, tmp_path_factory.mktemp("deq-gpu") / request.param)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_engine_fp8_matches_transformers_on_the_same_weights(fp8_checkpoints, enforce_eager):
    checkpoint, reference_checkpoint = fp8_checkpoints
    names = quantized_weight_names(checkpoint)
    cases = bf16_cases(TransformersReference(reference_checkpoint, "cuda",
                                             around=lambda model: fp8_activation_rounding(
                                                 model, names, 128, expert_w8a16_tokens=SMALL_BATCH_TOKENS)))
    engine = LLMEngine.from_config(EngineConfig(
        checkpoint=checkpoint, device="cuda", dtype="bfloat16", num_kv_blocks=256, block_size=16, max_model_len=1024,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_num_seqs=8, enforce_eager=enforce_eager,
    ))
    assert any(isinstance(m, Fp8Linear) for m in engine.executor.model.modules())
    run_engine_and_compare(engine, cases)
