"""The engine against transformers on a tiny checkpoint: transformers' own generate with its image processor (the
reference), an engine on the same checkpoint and a run of requests arriving at given steps."""

from __future__ import annotations

import io

import torch
from PIL import Image

from contract.types import FinishReason, PromptInput, SamplingParams
from workers.config import EngineConfig
from workers.engine import LLMEngine

IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD = 151644, 151645, 151652, 151653, 151655
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64  # small images keep the tests fast
NEW_TOKENS = 8


def transformers_reference(checkpoint, around=None):
    """transformers' generate with its own image processor: (images, text ids) -> (prompt, new tokens). around: a
    context manager factory, model -> context, entered around each generate (tests/helpers/fp8_reference.py's FP8
    arithmetic emulation)."""
    import contextlib

    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    around = around or (lambda _model: contextlib.nullcontext())
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )

    def run(images: list[bytes], text_ids: list[int], max_new_tokens: int = NEW_TOKENS):
        ids = [IM_START, 872, 198]
        kwargs = {}
        if images:
            pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            processed = processor(images=pil, return_tensors="pt")
            for t, h, w in processed["image_grid_thw"].tolist():
                ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
        ids += text_ids + [IM_END, 198, IM_START, 77091, 198]
        input_ids = torch.tensor([ids])
        if images:
            kwargs = dict(
                pixel_values=processed["pixel_values"],
                image_grid_thw=processed["image_grid_thw"],
                mm_token_type_ids=(input_ids == IMAGE_PAD).int(),
            )
        with torch.no_grad(), around(model):
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                do_sample=False, **kwargs,
            )
        return PromptInput(ids, list(images)), out[0, len(ids):].tolist()

    return run


def make_engine(checkpoint, **overrides) -> LLMEngine:
    settings = dict(
        checkpoint=checkpoint, num_kv_blocks=256, block_size=16, max_model_len=1024,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
    )
    settings.update(overrides)
    return LLMEngine.from_config(EngineConfig(**settings))


def run_to_completion(engine: LLMEngine, arrivals: dict[int, list[tuple[str, PromptInput]]], max_tokens=NEW_TOKENS):
    """Adds requests at the given step numbers and steps until all finish; returns tokens per request."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt in arrivals.pop(step, []):
            tokens[rid] = []
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP), out.error
        step += 1
    return tokens
