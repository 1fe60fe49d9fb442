"""transformers in bfloat16 as the reference for the engine's bf16 tests (CPU and CUDA): its greedy tokens and
per-step logits, and the comparison that lets a token differ only after a near-tie of its own top-2 logits."""

from __future__ import annotations

import io

import torch
from PIL import Image

from image_fixtures import png
from workers.types import PromptInput, SamplingParams

IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD = 151644, 151645, 151652, 151653, 151655
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64
NEW_TOKENS = 12
NEAR_TIE = 1e-2  # relative top-2 gap below which bf16 rounding may pick either token


def vision_inv_freq(n: int, theta: float = 10000.0) -> torch.Tensor:
    """The vision rotary's n frequencies in float32 (the 2-D rope over head_dim / 2 = 2n channels)."""
    return 1.0 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / (2 * n))


def float32_vision_tables(visual: torch.nn.Module) -> None:
    """The reference's vision position tables in float32, as transformers 5.24 and our tower compute them.
    Older transformers (5.17, on the GPU machine) resample the learned position embeddings with bilinear weights
    and partial sums in the embedding's dtype (`fast_pos_embed_interpolate`: bf16 in a bf16 model); the rotary
    frequencies are reset too, in case a bf16 load rounded that non-persistent buffer (0.1 -> 0.1001). Either
    moves every image feature by about a bf16 step: enough to flip a near-tie MoE routing choice in the tiny
    random model, and then a token that is no near-tie."""
    rotary = visual.rotary_pos_emb
    rotary.inv_freq = vision_inv_freq(rotary.inv_freq.numel()).to(rotary.inv_freq.device)
    interpolate = getattr(visual, "fast_pos_embed_interpolate", None)
    if interpolate is not None:  # transformers < 5.2x: weights in the embedding's dtype
        dtype = visual.pos_embed.weight.dtype
        visual.pos_embed.float()
        visual.fast_pos_embed_interpolate = lambda grid_thw: interpolate(grid_thw).to(dtype)


def bf16_reference(checkpoint, device: str):
    """transformers in bf16 on `device`: (images, text ids) -> (prompt, greedy tokens, per-step logits)."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device).eval()
    float32_vision_tables(model.model.visual)
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )

    def run(images: list[bytes], text_ids: list[int]):
        ids = [IM_START, 872, 198]
        kwargs = {}
        if images:
            processed = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
            for t, h, w in processed["image_grid_thw"].tolist():
                ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
        ids += text_ids + [IM_END, 198, IM_START, 77091, 198]
        input_ids = torch.tensor([ids], device=device)
        if images:
            kwargs = dict(
                pixel_values=processed["pixel_values"].to(device, torch.bfloat16),
                image_grid_thw=processed["image_grid_thw"].to(device),
                mm_token_type_ids=(input_ids == IMAGE_PAD).int(),
            )
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
            )
        tokens = out.sequences[0, len(ids):].tolist()
        return PromptInput(ids, list(images)), tokens, [step[0].float().cpu() for step in out.logits]

    return run


def assert_equal_or_near_tie(rid: str, got: list[int], expected: list[int], logits: list[torch.Tensor]) -> None:
    assert len(got) == len(expected), (rid, got, expected)
    for step, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            top2 = logits[step].topk(2).values
            gap = float((top2[0] - top2[1]) / top2[0].abs().clamp_min(1e-6))
            assert gap < NEAR_TIE, f"{rid}: token {step} is {a}, transformers {b}, its top-2 gap {gap:.3g} is no tie"
            print(f"{rid}: diverges at token {step} after a near-tie (relative top-2 gap {gap:.2e})")
            return


def bf16_cases(reference) -> dict:
    """The four prompts both bf16 tests run: text, one image, two images, a short text."""
    return {
        "text": reference([], list(range(1000, 1040))),
        "image": reference([png(67, 45, seed=1)], [3838, 374, 419]),
        "two-images": reference([png(130, 90, seed=2), png(40, 200, seed=3)], [3838, 374]),
        "short": reference([], [9707, 11, 1246]),
    }


def run_engine_and_compare(engine, cases: dict) -> None:
    for rid, (prompt, _, _) in cases.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=NEW_TOKENS))
    got = {rid: [] for rid in cases}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for rid, (_, expected, logits) in cases.items():
        assert_equal_or_near_tie(rid, got[rid], expected, logits)
