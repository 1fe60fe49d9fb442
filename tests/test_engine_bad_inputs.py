"""A request that cannot be served finishes alone with FinishReason.ERROR and a reason; its batch mates
and the engine carry on, and step() never raises."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from contract.types import FinishReason, PromptInput, SamplingParams
from workers.config import EngineConfig
from workers.engine import LLMEngine

IMAGE_PAD = 151655
MAX_MODEL_LEN = 64


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def with_pads(n: int, image: bytes) -> PromptInput:
    return PromptInput([151644, 151652] + [IMAGE_PAD] * n + [151653, 5, 6], [image])


@pytest.fixture(scope="module")
def engine(tiny_dense_checkpoint):
    return LLMEngine.from_config(EngineConfig(
        checkpoint=tiny_dense_checkpoint, num_kv_blocks=32, block_size=4, max_model_len=MAX_MODEL_LEN,
        min_pixels=4096, max_pixels=65536, max_image_pixels=1_000_000,
    ))


def serve_with_a_good_neighbour(engine: LLMEngine, bad: PromptInput):
    engine.add_request("good", PromptInput([1, 2, 3]), SamplingParams(max_tokens=4))
    engine.add_request("bad", bad, SamplingParams(max_tokens=4))
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
    assert last["good"].finish_reason is FinishReason.LENGTH and last["good"].num_generated_tokens == 4
    assert last["bad"].finished and last["bad"].finish_reason is FinishReason.ERROR
    assert last["bad"].new_token_ids == []
    return last["bad"].error


def test_prompt_longer_than_max_model_len_is_an_error(engine):
    error = serve_with_a_good_neighbour(engine, PromptInput(list(range(1, MAX_MODEL_LEN + 2))))
    assert "max_model_len" in error


def test_undecodable_image_is_an_error(engine):
    error = serve_with_a_good_neighbour(engine, with_pads(4, b"\x89PNG\r\n\x1a\nthis is not a png"))
    assert "image 0" in error


def test_an_undecodable_image_gets_the_same_error_text_each_time(engine):
    first, second = (serve_with_a_good_neighbour(engine, with_pads(4, b"not an image at all")) for _ in range(2))
    assert first == second and " at 0x" not in first and "format not recognised" in first


def test_empty_image_is_an_error(engine):
    assert "image 0" in serve_with_a_good_neighbour(engine, with_pads(4, b""))


def test_image_above_the_pixel_limit_is_an_error(engine):
    # 2000 x 1000 = 2 M pixels > max_image_pixels (1 M): a decompression bomb by this engine's rules.
    error = serve_with_a_good_neighbour(engine, with_pads(4, png(2000, 1000)))
    assert "exceeds the limit" in error


def test_image_pad_count_not_matching_the_image_is_an_error(engine):
    # 64x64 is 2x2 = 4 visual tokens; the prompt carries 5 pads.
    error = serve_with_a_good_neighbour(engine, with_pads(5, png(64, 64)))
    assert "5 <|image_pad|>" in error and "need 4" in error


def test_image_pads_without_an_image_are_an_error(engine):
    error = serve_with_a_good_neighbour(engine, PromptInput([1, IMAGE_PAD, IMAGE_PAD, 2]))
    assert "2 <|image_pad|>" in error


def test_token_id_outside_the_vocabulary_is_an_error(engine):
    assert "vocabulary" in serve_with_a_good_neighbour(engine, PromptInput([1, 10**7]))


def test_generation_stops_at_max_model_len_with_length(engine):
    engine.add_request("edge", PromptInput(list(range(1, MAX_MODEL_LEN - 2))), SamplingParams(max_tokens=50))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert outs[-1].num_prompt_tokens + outs[-1].num_generated_tokens <= MAX_MODEL_LEN


def test_abort_finishes_the_request_with_abort_and_frees_its_blocks(engine):
    free = engine.block_manager.num_free_blocks
    engine.add_request("gone", PromptInput([1, 2, 3, 4, 5]), SamplingParams(max_tokens=20))
    engine.step()
    assert engine.abort("gone")
    (out,) = engine.step()
    assert out.request_id == "gone" and out.finish_reason is FinishReason.ABORT
    assert engine.block_manager.num_free_blocks == free
    assert not engine.abort("gone") and not engine.has_unfinished()


def test_reusing_a_live_request_id_is_refused(engine):
    engine.add_request("dup", PromptInput([1, 2]), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PromptInput([3, 4]), SamplingParams(max_tokens=5))
    engine.abort("dup")
    engine.step()
