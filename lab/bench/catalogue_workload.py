"""The catalogue workloads the benchmarks run: the issue's fixed one (one square JPEG, random text tokens, a fixed
output length) and a synthetic catalogue drawn from the real dataset's statistics, built by the product's own path.

The realistic one: `harness.synthetic_catalogue` profile `realistic` (all JPEG; image sides and description lengths
from the plots in the MLPerf reference's dataset notebook
https://github.com/mlcommons/inference/blob/master/multimodal/qwen3-vl/notebooks/shopify-global-catalogue.ipynb),
loaded with `contract.dataset`, turned into the exact MLPerf prompt by
`contract.prompt.PromptBuilder` with the real Qwen vocabulary. Output lengths follow the v6.1 run's statistics (mean
42.9, median 42, p99 62, cap 150) as a normal of mean 42.9 and sd 8.6 rounded and clipped to [1, 150]; the
benchmark runs every request to exactly that many tokens (no EOS), so both sides do the same work.
"""

from __future__ import annotations

import io
import statistics
import tempfile
from dataclasses import dataclass

import numpy as np

from contract.stats import percentile
from contract.tokenizer import IM_END_ID, IM_START_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from contract.types import PromptInput

USER, ASSISTANT, NEWLINE = 872, 77091, 198  # "user", "assistant", "\n" in Qwen's vocabulary
OUTPUT_MEAN, OUTPUT_SD, OUTPUT_CAP = 42.9, 8.6, 150
WORKLOADS = ("fixed", "realistic")


@dataclass(frozen=True)
class CatalogueRequest:
    prompt: PromptInput
    output_tokens: int


def jpeg(size: int, seed: int) -> bytes:
    """A photo-sized square JPEG (smooth-ish content, so its file size is like a product photo's)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((size, size), Image.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def fixed_catalogue(samples: int, image_size: int, text_tokens: int, output_tokens: int, seed: int = 0) -> list[CatalogueRequest]:
    """The issue's catalogue-like workload: every sample one image_size^2 JPEG (8 distinct images in turn) plus
    text_tokens random text ids in the chat layout, output_tokens out."""
    from contract.vision_geometry import image_geometry

    rng = np.random.default_rng(seed)
    images = [jpeg(image_size, seed + i) for i in range(min(8, samples))]
    out = []
    for i in range(samples):
        data = images[i % len(images)]
        visual = image_geometry(data).num_tokens
        text = rng.integers(1000, 100000, text_tokens).tolist()
        ids = [IM_START_ID, USER, NEWLINE, VISION_START_ID] + [IMAGE_PAD_ID] * visual + [VISION_END_ID] + text
        ids += [IM_END_ID, NEWLINE, IM_START_ID, ASSISTANT, NEWLINE]
        out.append(CatalogueRequest(PromptInput(ids, [data]), output_tokens))
    return out


def output_lengths(samples: int, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, 7])
    return [int(x) for x in np.clip(np.rint(rng.normal(OUTPUT_MEAN, OUTPUT_SD, samples)), 1, OUTPUT_CAP)]


def realistic_catalogue(samples: int, seed: int = 0, variant: str = "v6.0") -> list[CatalogueRequest]:
    """`samples` prompts (of the prompt `variant`) of the synthetic catalogue with the real dataset's image sizes and
    text lengths."""
    from contract.dataset import load_catalogue
    from contract.prompt import PromptBuilder
    from contract.tokenizer import load_tokenizer
    from harness.synthetic_catalogue import write_synthetic_catalogue

    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_catalogue(tmp, samples, seed=seed, profile="realistic")
        prompts = PromptBuilder(load_tokenizer(), variant=variant).build_batch(list(load_catalogue(tmp)))
    bad = [p for p in prompts if isinstance(p, ValueError)]
    if bad:
        raise ValueError(f"{len(bad)} synthetic samples have no prompt, first: {bad[0]}")
    return [CatalogueRequest(p, n) for p, n in zip(prompts, output_lengths(samples, seed))]


def build_workload(kind: str, samples: int, image_size: int, text_tokens: int, output_tokens: int,
                   seed: int = 0) -> list[CatalogueRequest]:
    if kind == "fixed":
        return fixed_catalogue(samples, image_size, text_tokens, output_tokens, seed)
    if kind == "realistic":
        return realistic_catalogue(samples, seed)
    raise ValueError(f"unknown workload {kind!r}; expected one of {WORKLOADS}")


def describe(requests: list[CatalogueRequest]) -> dict:
    """What the requests hold: prompt / visual / output token counts (mean, median, p99, max)."""

    def stats(values: list[int]) -> dict:
        return {"mean": round(statistics.fmean(values), 1), "median": statistics.median(values),
                "p99": percentile(values, 0.99), "max": max(values)}

    return {
        "samples": len(requests),
        "prompt_tokens": stats([len(r.prompt.token_ids) for r in requests]),
        "visual_tokens": stats([r.prompt.token_ids.count(IMAGE_PAD_ID) for r in requests]),
        "output_tokens": stats([r.output_tokens for r in requests]),
    }


def longest_request(requests: list[CatalogueRequest]) -> int:
    """Prompt plus output tokens of the longest request (the engine's max_model_len must cover it)."""
    return max(len(r.prompt.token_ids) + r.output_tokens for r in requests)
