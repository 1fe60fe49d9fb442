"""The MLPerf q3vl prompt, word for word, in its two published variants, and the response schema.

v6.0 = the LoadGen reference (`mlperf_inf_mm_q3vl/task.py`, typos kept); v6.1 = the endpoints preset.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from contract.chat import RenderedChat, render_chat, tokenize_rendered
from contract.dataset import CatalogueSample
from contract.tokenizer import QwenTokenizer
from contract.types import PromptInput
from contract.vision_geometry import MAX_PIXELS, MIN_PIXELS

Variant = Literal["v6.0", "v6.1"]


class ProductMetadata(BaseModel):
    """Json format for the expected responses from the VLM."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    category: str
    """The complete category of the product, e.g.,
    "Clothing & Accessories > Clothing > Shirts > Polo Shirts".
    Each categorical level is separated by " > ".
    """

    brand: str
    """The brand of the product, e.g., "giorgio armani"."""

    is_secondhand: bool
    """True if the product is second-hand, False otherwise."""


class ProductMetadataV61(BaseModel):
    """JSON format for expected VLM responses (matches MLCommons Q3VL schema).

    Reference: https://github.com/mlcommons/inference/blob/master/multimodal/qwen3-vl/src/mlperf_inf_mm_q3vl/schema.py
    """

    # The endpoints model: no attribute docstrings in the schema, same title as the reference.
    model_config = ConfigDict(extra="forbid", title="ProductMetadata")

    category: str
    brand: str
    is_secondhand: bool


@dataclass(frozen=True)
class PromptVariant:
    """What differs between the two published prompts."""

    schema_model: type[BaseModel]
    specific: str  # the reference's typo "specifc" or the fixed word
    following: str  # the reference's typo "followng" or the fixed word
    format_categories: Callable[[list[str]], str]  # Python list repr (v6.0) or json.dumps (v6.1)


VARIANTS: dict[str, PromptVariant] = {
    "v6.0": PromptVariant(ProductMetadata, "specifc", "followng", repr),
    "v6.1": PromptVariant(ProductMetadataV61, "specific", "following", json.dumps),
}


def _variant(variant: str) -> PromptVariant:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise ValueError(f"unknown prompt variant {variant!r}; expected one of {sorted(VARIANTS)}") from None


def schema_text(variant: Variant = "v6.0") -> str:
    """The response schema exactly as the prompt shows it."""
    return json.dumps(_variant(variant).schema_model.model_json_schema(), indent=2)


def system_prompt(variant: Variant = "v6.0") -> str:
    v = _variant(variant)
    return f"""Please analyze the product from the user prompt
and provide the following fields in a valid JSON object:
- category
- brand
- is_secondhand

You must choose only one, which is the most appropriate, correct, and {v.specific}
category out of the list of possible product categories.

The description of the product sometimes contains various types of source code
(e.g., JavaScript, CSS, HTML, etc.), where useful product information is embedded
somewhere inside the source code. For this task, you should extract the useful
product information from the source code and leverage it, and discard the
programmatic parts of the source code.

Your response should only contain a valid JSON object and nothing more, e.g.,
you should not fence the JSON object inside a ```json code block.
The JSON object should match the {v.following} JSON schema:
```json
{schema_text(variant)}
```
"""


def user_text(sample: CatalogueSample, variant: Variant = "v6.0") -> str:
    categories = _variant(variant).format_categories(list(sample.categories))
    return f"""The title of the product is the following:
```text
{sample.title}
```

The description of the product is the following:
```text
{sample.description}
```

The following are the possible product categories:
```json
{categories}
```
"""


def _messages(sample: CatalogueSample, variant: Variant, image_part: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system_prompt(variant)},
        {"role": "user", "content": [{"type": "text", "text": user_text(sample, variant)}, image_part]},
    ]


def build_messages(sample: CatalogueSample, variant: Variant = "v6.0") -> list[dict[str, Any]]:
    """OpenAI chat messages as the reference sends them (image as a data URL of its stored bytes)."""
    b64 = base64.b64encode(sample.image_bytes).decode("ascii")
    url = f"data:image/{sample.image_format};base64,{b64}"
    return _messages(sample, variant, {"type": "image_url", "image_url": {"url": url}})


def render_sample(sample: CatalogueSample, variant: Variant = "v6.0", min_pixels: int = MIN_PIXELS,
                  max_pixels: int = MAX_PIXELS) -> RenderedChat:
    """The sample's chat-template text and image, with no base64 round trip."""
    return render_chat(_messages(sample, variant, {"type": "image", "image": sample.image_bytes}),
                       min_pixels, max_pixels)


def build_prompt(sample: CatalogueSample, tokenizer: QwenTokenizer, variant: Variant = "v6.0",
                 min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> PromptInput:
    """Token ids (image pads expanded) + the image bytes; ValueError names the sample it cannot build."""
    (prompt,) = PromptBuilder(tokenizer, variant, min_pixels, max_pixels).build_batch([sample])
    if isinstance(prompt, ValueError):
        raise prompt
    return prompt


@dataclass(frozen=True)
class PromptBuilder:
    """sample -> PromptInput for the sample store; build_batch tokenizes many samples in one call."""

    tokenizer: QwenTokenizer
    variant: Variant = "v6.0"
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    def __post_init__(self) -> None:
        _variant(self.variant)

    def __call__(self, sample: CatalogueSample) -> PromptInput:
        return build_prompt(sample, self.tokenizer, self.variant, self.min_pixels, self.max_pixels)

    def build_batch(self, samples: Sequence[CatalogueSample]) -> list[PromptInput | ValueError]:
        """One result per sample, in order: its prompt, or a ValueError naming the sample index."""
        results: list[PromptInput | ValueError | None] = []
        rendered: list[RenderedChat] = []
        slots: list[int] = []
        for sample in samples:
            try:
                r = render_sample(sample, self.variant, self.min_pixels, self.max_pixels)
            except ValueError as exc:
                results.append(ValueError(f"sample {sample.index}: {exc}"))
                continue
            slots.append(len(results))
            results.append(None)
            rendered.append(r)
        for slot, prompt in zip(slots, tokenize_rendered(rendered, self.tokenizer)):
            if isinstance(prompt, ValueError):
                prompt = ValueError(f"sample {samples[slot].index}: {prompt}")
            results[slot] = prompt
        return results  # type: ignore[return-value]
