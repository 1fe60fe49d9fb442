"""Disaggregation and replay: a prefill engine's exported KV continues on a second engine exactly as one
engine would have decoded, and resumed tokens continue a request without being streamed again."""

from __future__ import annotations

import io

import numpy as np
import torch
import pytest
from PIL import Image

from contract.types import FinishReason, PromptInput, SamplingParams
from tests.helpers.scheduler_spies import record_encodes
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_cache import KvExport
from workers.request_options import RequestOptions

IMAGE_PAD = 151655
GREEDY = SamplingParams(max_tokens=10)


def image_prompt() -> PromptInput:
    pixels = np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    # 70x90 with min_pixels 4096 resizes to 64x96: 2 x 3 = 6 visual tokens.
    return PromptInput([151644, 872, 198, 151652] + [IMAGE_PAD] * 6 + [151653, 3838, 374, 151645, 198], [buf.getvalue()])


@pytest.fixture(scope="module")
def engines(tiny_moe_checkpoint):
    def make(**kw):
        return LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=64, block_size=4,
                                                  max_model_len=256, min_pixels=4096, max_pixels=65536, **kw))
    return make(), make(), make(dtype="bfloat16")


def drain(engine: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_prefill_only_samples_one_token_and_holds_kv_until_released(engines):
    prefill, _, _ = engines
    free = prefill.block_manager.num_free_blocks
    prefill.add_request("p", image_prompt(), GREEDY, RequestOptions(prefill_only=True))
    (last,) = drain(prefill)["p"]
    assert last.finished and last.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert len(last.new_token_ids) == 1
    assert prefill.block_manager.num_free_blocks < free
    export = prefill.export_kv("p")
    assert export.num_tokens == len(image_prompt().token_ids)
    assert export.first_token_id == last.new_token_ids[0]
    assert prefill.release("p")
    assert prefill.block_manager.num_free_blocks == free
    with pytest.raises(KeyError):
        prefill.export_kv("p")


def whole_then_prefill_split(prefill, decode):
    """The image prompt generated whole on `decode` (its tokens), then prefilled alone on `prefill`: (the whole
    run's tokens, prefill's first token, its KV export; the prefill request released)."""
    decode.add_request("whole", image_prompt(), GREEDY)
    expected = tokens(drain(decode)["whole"])
    prefill.add_request("split", image_prompt(), GREEDY, RequestOptions(prefill_only=True))
    first = tokens(drain(prefill)["split"])
    export = prefill.export_kv("split")
    prefill.release("split")
    return expected, first, export


def test_kv_exported_by_one_engine_continues_on_another_with_identical_tokens(engines):
    prefill, decode, _ = engines
    encodes = record_encodes(decode)
    expected, first, export = whole_then_prefill_split(prefill, decode)
    # Over the wire the KV travels as raw bytes per layer.
    received = KvExport.from_layer_bytes(
        num_tokens=export.num_tokens, first_token_id=export.first_token_id,
        mrope_position_delta=export.mrope_position_delta, num_kv_heads=export.num_kv_heads,
        head_dim=export.head_dim, dtype_name=export.dtype_name,
        layers=[export.layer_bytes(i) for i in range(export.num_layers)],
    )
    # Its image is in the imported KV: the decode engine, which encoded it for the whole run, never encodes it.
    decode.add_request("split", image_prompt(), SamplingParams(max_tokens=GREEDY.max_tokens - 1), RequestOptions(kv_import=received))
    rest = drain(decode)["split"]
    assert {rid for _, rid, _ in encodes} == {"whole"}
    assert first + tokens(rest) == expected
    assert rest[-1].num_generated_tokens == GREEDY.max_tokens - 1


def test_kv_import_into_an_engine_of_another_dtype_is_converted(engines):
    prefill, _, decode_bf16 = engines
    prefill.add_request("x", image_prompt(), GREEDY, RequestOptions(prefill_only=True))
    drain(prefill)
    export = prefill.export_kv("x")
    prefill.release("x")
    decode_bf16.add_request("x", image_prompt(), SamplingParams(max_tokens=3), RequestOptions(kv_import=export))
    (*_, last) = drain(decode_bf16)["x"]
    assert last.finished and last.finish_reason is not FinishReason.ERROR and last.num_generated_tokens == 3


def test_kv_import_for_a_different_prompt_is_rejected(engines):
    prefill, decode, _ = engines
    prefill.add_request("y", PromptInput([1, 2, 3, 4, 5]), GREEDY, RequestOptions(prefill_only=True))
    drain(prefill)
    export = prefill.export_kv("y")
    prefill.release("y")
    decode.add_request("y", PromptInput([1, 2, 3]), GREEDY, RequestOptions(kv_import=export))
    (out,) = drain(decode)["y"]
    assert out.finish_reason is FinishReason.ERROR and "covers 5 tokens" in out.error


def test_resumed_request_continues_after_its_resume_tokens_without_streaming_them(engines):
    _, decode, _ = engines
    prompt = PromptInput([151644, 872, 198, 1, 2, 3, 151645, 198])
    decode.add_request("full", prompt, GREEDY)
    expected = tokens(drain(decode)["full"])
    decode.add_request("resumed", prompt, SamplingParams(max_tokens=6), RequestOptions(resume_token_ids=expected[:4]))
    outs = drain(decode)["resumed"]
    assert tokens(outs) == expected[4:]
    assert outs[-1].num_generated_tokens == 6


def test_fp8_kv_crosses_the_wire_into_another_fp8_engine_bit_exact_with_its_scales(tiny_moe_checkpoint):
    from workers.kv_cache import FP8_DTYPE, KvCache
    from workers.serve.kv_wire import kv_from_chunks, kv_to_chunks

    def make():
        return LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=64, block_size=4, max_model_len=256,
                                                  min_pixels=4096, max_pixels=65536, kv_cache_dtype="fp8"))
    prefill, decode = make(), make()
    scales = [(0.5, 0.25)] * len(prefill.executor.kv.layers)  # not the default: the scales must travel too
    for engine in (prefill, decode):  # a fresh pool with these scales, as a checkpoint's k/v_scale would give
        layers, block_size, heads, head_dim = engine.executor._kv_shape
        engine.executor.kv = KvCache(layers, engine.executor.num_kv_blocks + 1, block_size, heads, head_dim, FP8_DTYPE,
                                   engine.executor.device, scales)
    expected, first, export = whole_then_prefill_split(prefill, decode)
    assert export.dtype_name == "float8_e4m3fn" and export.scales == scales
    received = kv_from_chunks(kv_to_chunks(export), export.first_token_id)  # the proto messages PullKv streams
    assert received.scales == scales
    decode.add_request("split", image_prompt(), SamplingParams(max_tokens=GREEDY.max_tokens - 1), RequestOptions(kv_import=received))
    outs = {}
    while "split" not in outs or not outs["split"][-1].finished:
        for out in decode.step():
            outs.setdefault(out.request_id, []).append(out)
        seq = decode.scheduler.find("split")
        if seq is not None and "imported" not in outs:  # after the step that copied the KV in
            outs["imported"] = decode.executor.kv.gather(seq.block_table, export.num_tokens).clone()
    assert torch.equal(outs["imported"].view(torch.uint8), export.stacked().view(torch.uint8))
    assert first + tokens(outs["split"]) == expected


def test_an_fp8_engine_imports_bfloat16_kv_by_quantizing_it(engines, tiny_moe_checkpoint):
    _, _, prefill_bf16 = engines
    prefill_bf16.add_request("q", image_prompt(), GREEDY, RequestOptions(prefill_only=True))
    drain(prefill_bf16)
    export = prefill_bf16.export_kv("q")
    prefill_bf16.release("q")
    assert export.scales is None
    decode = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=64, block_size=4, max_model_len=256,
                                                min_pixels=4096, max_pixels=65536, kv_cache_dtype="fp8"))
    decode.add_request("q", image_prompt(), SamplingParams(max_tokens=3), RequestOptions(kv_import=export))
    (*_, last) = drain(decode)["q"]
    assert last.finished and last.finish_reason is not FinishReason.ERROR and last.num_generated_tokens == 3


def without_images(prompt: PromptInput) -> PromptInput:
    return PromptInput(list(prompt.token_ids))


def test_the_export_describes_the_prompts_images_by_grid_and_digest(engines):
    prefill, decode, _ = engines
    _, _, export = whole_then_prefill_split(prefill, decode)
    (image,) = export.image_layout
    assert (image.grid_rows, image.grid_cols) == (2, 3)  # 64x96 pixels, 32 pixels a visual token
    assert image.num_tokens == image_prompt().token_ids.count(IMAGE_PAD)


def test_kv_import_sent_without_its_images_continues_with_identical_tokens_and_decodes_no_image(engines):
    prefill, decode, _ = engines
    encodes = record_encodes(decode)
    expected, first, export = whole_then_prefill_split(prefill, decode)
    decode.add_request("bare", without_images(image_prompt()), SamplingParams(max_tokens=GREEDY.max_tokens - 1),
                       RequestOptions(kv_import=export))
    rest = drain(decode)["bare"]
    assert first + tokens(rest) == expected
    assert {rid for _, rid, _ in encodes} == {"whole"}


def test_kv_import_without_images_whose_pad_run_disagrees_with_the_layout_is_rejected(engines):
    prefill, decode, _ = engines
    _, _, export = whole_then_prefill_split(prefill, decode)
    ids = list(image_prompt().token_ids)
    ids.remove(IMAGE_PAD)  # 5 <|image_pad|> where the layout says 2 x 3
    ids.insert(0, 198)  # the same length, so only the layout check can tell
    decode.add_request("short", PromptInput(ids), GREEDY, RequestOptions(kv_import=export))
    (out,) = drain(decode)["short"]
    assert out.finish_reason is FinishReason.ERROR and "5 <|image_pad|> tokens" in out.error


def test_kv_import_without_images_whose_layout_gives_another_mrope_delta_is_rejected(engines):
    prefill, decode, _ = engines
    _, _, export = whole_then_prefill_split(prefill, decode)
    (image,) = export.image_layout
    export.image_layout = (type(image)(1, 6, image.digest),)  # 6 tokens still, but one row: MRoPE delta 0, not -3
    decode.add_request("flat", without_images(image_prompt()), GREEDY, RequestOptions(kv_import=export))
    (out,) = drain(decode)["flat"]
    assert out.finish_reason is FinishReason.ERROR and "MRoPE delta" in out.error


def test_a_kv_import_without_its_images_that_is_preempted_finishes_preempted_with_its_tokens_so_far(
        tiny_moe_checkpoint, engines):
    prefill, decode, _ = engines
    _, first, export = whole_then_prefill_split(prefill, decode)
    small = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=8, block_size=4, max_model_len=256,
                                               min_pixels=4096, max_pixels=65536))
    small.add_request("older", PromptInput([151644, 872, 198, 1, 2, 3, 151645, 198]), SamplingParams(max_tokens=20))
    small.step()  # the older request runs first: when blocks run out, the imported one is the youngest
    small.add_request("bare", without_images(image_prompt()), SamplingParams(max_tokens=20), RequestOptions(kv_import=export))
    outs = drain(small)
    assert outs["bare"][-1].finish_reason is FinishReason.PREEMPTED
    assert "images" in outs["bare"][-1].error
    assert outs["older"][-1].finish_reason is FinishReason.LENGTH
