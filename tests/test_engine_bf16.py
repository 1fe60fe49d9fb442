"""In bfloat16 on CPU the engine (its torch reference paths: the vision tower's fused-kernel references, paged
attention, the MoE) generates what transformers generates in bfloat16, up to a first divergence that float32
transformers cannot tell from bf16 rounding (tests/helpers/bf16_reference.py). The CUDA twin is
tests/test_engine_gpu.py."""

from __future__ import annotations

import pytest

from tests.helpers.bf16_reference import (MAX_PIXELS, MIN_PIXELS, TransformersReference, bf16_cases, compare,
                                          run_engine_and_compare)
from workers.config import EngineConfig
from workers.engine import LLMEngine


@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_engine_matches_transformers_in_bfloat16_on_cpu(request, arch):
    checkpoint = request.getfixturevalue(f"tiny_{arch}_checkpoint")
    cases = bf16_cases(TransformersReference(checkpoint, "cpu"))
    engine = LLMEngine.from_config(EngineConfig(
        checkpoint=checkpoint, device="cpu", dtype="bfloat16", num_kv_blocks=256, block_size=16, max_model_len=1024,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_num_seqs=8,
    ))
    run_engine_and_compare(engine, cases)


@pytest.fixture(scope="module")
def short_moe_case(tiny_moe_checkpoint):
    return TransformersReference(tiny_moe_checkpoint, "cpu")([], [9707, 11, 1246])


def test_a_token_float32_transformers_ranks_last_fails_the_comparison(short_moe_case):
    case, step = short_moe_case, 2
    worst = int(case.float32_logits(case.tokens[:step]).argmin())
    got = case.tokens[:step] + [worst] + case.tokens[step + 1:]
    with pytest.raises(AssertionError, match=f"short: token {step} is {worst}, transformers {case.tokens[step]}"):
        compare("short", got, case)


def test_a_token_float32_transformers_prefers_to_the_bf16_reference_passes(short_moe_case):
    case = short_moe_case
    for step in range(len(case.tokens)):
        best = int(case.float32_logits(case.tokens[:step]).argmax())
        if best != case.tokens[step]:
            break
    else:
        pytest.fail("bf16 transformers matched float32's greedy choice at every step: nothing to arbitrate")
    compare("short", case.tokens[:step] + [best] + case.tokens[step + 1:], case)
