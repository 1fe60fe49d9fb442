"""transformers as the reference for the engine's bf16 tests (CPU and CUDA): greedy tokens and per-step logits in
bf16, and a float32 arbiter that judges the first token where the engine departs from them."""

from __future__ import annotations

import io
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from PIL import Image

from contract.types import PromptInput, SamplingParams
from tests.helpers.image_fixtures import png

IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD = 151644, 151645, 151652, 151653, 151655
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64
NEW_TOKENS = 12
# E = bf16 transformers' largest logit error against float32 at the step, taken as the size of the engine's own
# bf16 error (the same precision, other kernels and orders). Errors of up to E on each of two logits, in opposite
# directions, move their gap by up to 2E: a float32 gap below that can flip.
ARBITER_K = 2.0


def vision_inv_freq(n: int, theta: float = 10000.0) -> torch.Tensor:
    """The vision rotary's n frequencies in float32 (the 2-D rope over head_dim / 2 = 2n channels)."""
    return 1.0 / theta ** (torch.arange(0, 2 * n, 2, dtype=torch.float) / (2 * n))


def float32_vision_tables(visual: torch.nn.Module) -> None:
    """The bf16 reference's vision position tables in float32, as our tower and transformers 5.24 compute them.
    Older transformers (5.17, on the GPU machine) resample the learned position embeddings with bilinear weights
    and partial sums in the embedding's dtype (`fast_pos_embed_interpolate`: bf16 in a bf16 model); the rotary
    frequencies are reset too, in case a bf16 load rounded that non-persistent buffer (0.1 -> 0.1001). A no-op on
    5.24. This removes one version difference from the reference; it did not remove the H200 divergence on the
    MoE "two-images" prompt (token 4), which persisted with it and is left to the float32 arbiter."""
    rotary = visual.rotary_pos_emb
    rotary.inv_freq = vision_inv_freq(rotary.inv_freq.numel()).to(rotary.inv_freq.device)
    interpolate = getattr(visual, "fast_pos_embed_interpolate", None)
    if interpolate is not None:  # transformers < 5.2x: weights in the embedding's dtype
        dtype = visual.pos_embed.weight.dtype
        visual.pos_embed.float()
        visual.fast_pos_embed_interpolate = lambda grid_thw: interpolate(grid_thw).to(dtype)


@contextmanager
def no_tf32():
    """float32 matmuls and convolutions at full precision on CUDA (cuDNN convolutions, such as the vision patch
    embedding's Conv3d, default to TF32, which would blur the arbiter); a no-op on CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@dataclass
class Case:
    """One prompt: the engine's input, bf16 transformers' greedy tokens and per-step logits (float32 copies on the
    CPU), and float32 transformers' next-token logits after the prompt and a given prefix of generated tokens."""

    prompt: PromptInput
    tokens: list[int]
    logits: list[torch.Tensor]
    float32_logits: Callable[[list[int]], torch.Tensor]


class TransformersReference:
    """transformers on one checkpoint and device, `(images, text ids) -> Case`. The bf16 model loads at once; the
    float32 one at the first divergence it judges, then stays for the reference's other prompts."""

    def __init__(self, checkpoint, device: str, around=None):
        """around: a context manager factory, model -> context, entered around each generate (the FP8 arithmetic
        emulation of tests/helpers/fp8_reference.py)."""
        import contextlib

        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.checkpoint, self.device = checkpoint, device
        self.around = around or (lambda _model: contextlib.nullcontext())
        self.models: dict[torch.dtype, torch.nn.Module] = {}
        self.processor = Qwen2VLImageProcessorPil(
            size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
            patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        )
        self.model(torch.bfloat16)

    def model(self, dtype: torch.dtype) -> torch.nn.Module:
        if dtype not in self.models:
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(self.checkpoint, dtype=dtype).to(self.device).eval()
            if dtype == torch.bfloat16:
                float32_vision_tables(model.model.visual)
            self.models[dtype] = model
        return self.models[dtype]

    def __call__(self, images: list[bytes], text_ids: list[int]) -> Case:
        ids = [IM_START, 872, 198]
        pixels = {}
        if images:
            processed = self.processor(
                images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt"
            )
            for t, h, w in processed["image_grid_thw"].tolist():
                ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // 4) + [VISION_END]
            pixels = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        ids += text_ids + [IM_END, 198, IM_START, 77091, 198]
        tokens, logits = self.generate(torch.bfloat16, ids, pixels, NEW_TOKENS)
        return Case(
            PromptInput(ids, list(images)), tokens, logits,
            lambda prefix: self.generate(torch.float32, ids + prefix, pixels, 1)[1][0],
        )

    def generate(self, dtype: torch.dtype, ids: list[int], pixels: dict, n: int):
        """n greedy tokens after `ids` and their raw logits; the pixels (float32 from the processor) in `dtype`."""
        input_ids = torch.tensor([ids], device=self.device)
        kwargs = {}
        if pixels:
            kwargs = dict(
                pixel_values=pixels["pixel_values"].to(self.device, dtype),
                image_grid_thw=pixels["image_grid_thw"].to(self.device),
                mm_token_type_ids=(input_ids == IMAGE_PAD).int(),
            )
        model = self.model(dtype)
        with torch.no_grad(), no_tf32(), self.around(model):
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
            )
        return out.sequences[0, len(ids):].tolist(), [step[0].float().cpu() for step in out.logits]


def judge_divergence(
    rid: str, step: int, engine_token: int, reference_token: int,
    bf16_logits: torch.Tensor, float32_logits: torch.Tensor,
) -> str:
    """Accept the engine's `engine_token` where bf16 transformers chose `reference_token` when float32 transformers
    prefers the engine's token or prefers the reference's by at most ARBITER_K x bf16 transformers' own error at
    this step (its largest over the vocabulary). Returns the line to print; AssertionError otherwise."""
    error = float((bf16_logits - float32_logits).abs().max())
    gap = float(float32_logits[reference_token] - float32_logits[engine_token])
    assert gap <= ARBITER_K * error, (
        f"{rid}: token {step} is {engine_token}, transformers {reference_token}; float32 prefers {reference_token} "
        f"by {gap:.3g}, more than {ARBITER_K:g} x bf16 transformers' error {error:.3g}"
    )
    verdict = f"prefers the engine's by {abs(gap):.3g}" if gap <= 0 else f"prefers transformers' by {gap:.3g}"
    return (
        f"{rid}: diverges at token {step} ({engine_token}, transformers {reference_token}): float32 {verdict}, "
        f"bf16 transformers' error {error:.3g}"
    )


def compare(rid: str, got: list[int], case: Case) -> None:
    """The engine's tokens equal the reference's up to a first divergence the float32 arbiter accepts (later tokens
    follow a different prefix and are not compared)."""
    assert len(got) == len(case.tokens), (rid, got, case.tokens)
    step = next((i for i, (a, b) in enumerate(zip(got, case.tokens)) if a != b), None)
    if step is not None:
        l32 = case.float32_logits(case.tokens[:step])
        print(judge_divergence(rid, step, got[step], case.tokens[step], case.logits[step], l32))


def bf16_cases(reference: TransformersReference) -> dict[str, Case]:
    """The four prompts both bf16 tests run: text, one image, two images, a short text."""
    return {
        "text": reference([], list(range(1000, 1040))),
        "image": reference([png(67, 45, seed=1)], [3838, 374, 419]),
        "two-images": reference([png(130, 90, seed=2), png(40, 200, seed=3)], [3838, 374]),
        "short": reference([], [9707, 11, 1246]),
    }


def run_engine_and_compare(engine, cases: dict[str, Case]) -> None:
    for rid, case in cases.items():
        engine.add_request(rid, case.prompt, SamplingParams(max_tokens=NEW_TOKENS))
    got = {rid: [] for rid in cases}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for rid, case in cases.items():
        compare(rid, got[rid], case)
