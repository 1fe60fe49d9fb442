"""The float32 arbiter of the bf16 engine tests, on synthetic logits: a divergence from bf16 transformers passes
when float32 cannot separate the two tokens by more than twice bf16's own error, or prefers the engine's token."""

from __future__ import annotations

import pytest
import torch

from contract.types import PromptInput
from tests.helpers.bf16_reference import Case, compare, judge_divergence

ENGINE, REFERENCE, FAR = 2, 5, 7


def logits(values: dict[int, float] | None = None) -> torch.Tensor:
    """Eight-token logits, zero but for `values` (token -> logit)."""
    out = torch.zeros(8)
    for token, value in (values or {}).items():
        out[token] = value
    return out


def test_a_divergence_float32_cannot_separate_within_the_bf16_error_is_accepted():
    l32 = logits({ENGINE: 5.0, REFERENCE: 5.1})
    l16 = l32 + logits({REFERENCE: 0.06})  # bf16 error 0.06; float32 gap 0.1 <= 2 x 0.06
    line = judge_divergence("image", 4, ENGINE, REFERENCE, l16, l32)
    assert line.startswith("image: diverges at token 4 (2, transformers 5)")


def test_a_token_float32_prefers_is_accepted_even_without_bf16_error():
    l32 = logits({ENGINE: 6.0, REFERENCE: 5.0})
    line = judge_divergence("text", 0, ENGINE, REFERENCE, l32.clone(), l32)
    assert "prefers the engine's by 1" in line


def test_a_clear_float32_preference_for_transformers_token_fails_naming_prompt_step_tokens_gap_and_error():
    l32 = logits({ENGINE: 4.0, REFERENCE: 5.0})
    l16 = l32 + logits({REFERENCE: 0.1})
    with pytest.raises(AssertionError) as failure:
        judge_divergence("two-images", 3, ENGINE, REFERENCE, l16, l32)
    message = str(failure.value)
    assert message.startswith("two-images: token 3 is 2, transformers 5")
    assert "by 1," in message and "error 0.1" in message


def test_the_bf16_error_is_its_largest_over_the_vocabulary():
    l32 = logits({ENGINE: 4.0, REFERENCE: 5.0})
    l16 = l32 + logits({FAR: -0.6})  # an error far from the two tokens still sizes the tolerance: 1.0 <= 2 x 0.6
    judge_divergence("short", 1, ENGINE, REFERENCE, l16, l32)


def fake_case(tokens: list[int], l32: torch.Tensor, prefixes: list[list[int]]) -> Case:
    def float32_logits(prefix):
        prefixes.append(prefix)
        return l32

    return Case(PromptInput([1, 2, 3], []), tokens, [l32.clone() for _ in tokens], float32_logits)


def test_equal_tokens_never_run_the_float32_arbiter():
    prefixes = []
    compare("text", [4, 5, 6], fake_case([4, 5, 6], logits(), prefixes))
    assert prefixes == []


def test_only_the_first_divergence_is_judged_on_the_common_prefix():
    prefixes = []
    case = fake_case([3, 4, REFERENCE, FAR, FAR], logits({ENGINE: 1.0}), prefixes)  # float32 prefers the engine's token
    compare("text", [3, 4, ENGINE, 0, 0], case)
    assert prefixes == [[3, 4]]


def test_an_engine_that_generates_a_different_number_of_tokens_fails():
    with pytest.raises(AssertionError, match="text"):
        compare("text", [3, 4], fake_case([3, 4, 5], logits(), []))
