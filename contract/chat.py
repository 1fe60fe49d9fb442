"""OpenAI-style chat messages -> Qwen3-VL Instruct prompt token ids, images expanded to their visual tokens.

Follows the Qwen3-VL chat template (no tools): system turn, user/assistant turns, then the assistant opening.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contract.tokenizer import IMAGE_PAD_ID, QwenTokenizer
from contract.types import PromptInput
from contract.vision_geometry import MAX_PIXELS, MIN_PIXELS, ImageGeometryError, image_geometry

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
GENERATION_PROMPT = "<|im_start|>assistant\n"


class MessageError(ValueError):
    """A message, or a part of one, that cannot be used. `param` names it as OpenAI's error `param` would
    (`messages[0].content[1].image_url`), and the message starts with it."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


@dataclass(frozen=True)
class RenderedChat:
    """The template's text (one <|image_pad|> per image, as the chat template writes it), the images
    and each image's visual-token count."""

    text: str
    images: list[bytes]
    visual_tokens: list[int]


def render_chat(
    messages: Sequence[Mapping[str, Any]], min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> RenderedChat:
    """Applies the Qwen3-VL Instruct chat template with the generation prompt and sizes the images from
    their headers; raises MessageError naming the message, part or image that cannot be used."""
    if not messages:
        raise ValueError("messages is empty")
    parts: list[str] = []
    images: list[tuple[str, bytes]] = []  # (the part it came from, its bytes)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise MessageError(where, f"a message must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role == "system":
            if i != 0:
                raise MessageError(where, "a system message is only allowed first")
            parts.append(f"<|im_start|>system\n{_render_content(content, where, images=None)}<|im_end|>\n")
        elif role in ("user", "assistant"):
            images_ok = images if role == "user" else None
            parts.append(f"<|im_start|>{role}\n{_render_content(content, where, images_ok)}<|im_end|>\n")
        else:
            raise MessageError(f"{where}.role", f"unsupported role {role!r} (expected system, user or assistant)")
    parts.append(GENERATION_PROMPT)
    counts = _visual_token_counts(images, min_pixels, max_pixels)
    return RenderedChat("".join(parts), [data for _, data in images], counts)


def _render_content(content: Any, where: str, images: list[tuple[str, bytes]] | None) -> str:
    """Text of one message's content; images (user turns only) are appended to `images` in order, each with
    the param that names its part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise MessageError(f"{where}.content",
                           f"content must be a string or a list of parts, got {type(content).__name__}")
    out: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, Mapping):
            raise MessageError(at, f"a content part must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind in ("image", "image_url") or "image" in part or "image_url" in part:
            if images is None:
                raise MessageError(at, "images are only allowed in user messages")
            field = "image" if "image" in part else "image_url"
            images.append((f"{at}.{field}", _image_bytes(part, f"{at}.{field}")))
            out.append(IMAGE_PLACEHOLDER)
        elif "text" in part:
            text = part["text"]
            if not isinstance(text, str):
                raise MessageError(f"{at}.text", "text must be a string")
            out.append(text)
        else:
            raise MessageError(at, f"unsupported content part type {kind!r}")
    return "".join(out)


def _image_bytes(part: Mapping[str, Any], param: str) -> bytes:
    """The encoded image of an `image` (raw bytes) or `image_url` (data: URL) part; `param` names its field."""
    if "image" in part:
        data = part["image"]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MessageError(param, "'image' must hold the encoded image bytes")
        return bytes(data)
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
    if not isinstance(url, str):
        raise MessageError(param, "image_url.url is missing")
    return decode_data_url(url, param)


def decode_data_url(url: str, at: str = "image_url") -> bytes:
    """Bytes of a `data:image/...;base64,...` URL. Remote URLs are refused: nothing here fetches. MessageError
    names `at`."""
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("http", "https"):
        raise MessageError(at, f"remote image URLs are not fetched ({url[:80]}); send a data: URL")
    if scheme != "data":
        raise MessageError(at, f"unsupported image URL scheme {scheme!r}; send a data: URL")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MessageError(at, "data URL must be base64 encoded (data:image/<format>;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MessageError(at, f"bad base64 in data URL: {exc}") from exc


def expand_image_pads(token_ids: list[int], visual_tokens: Sequence[int]) -> list[int]:
    """Replaces the k-th <|image_pad|> with visual_tokens[k] copies of it (a prompt without images: token_ids
    itself)."""
    pads = [i for i, t in enumerate(token_ids) if t == IMAGE_PAD_ID] if IMAGE_PAD_ID in token_ids else []
    if len(pads) != len(visual_tokens):
        raise ValueError(f"prompt has {len(pads)} <|image_pad|> tokens but {len(visual_tokens)} images")
    if not pads:
        return token_ids
    out: list[int] = []
    start = 0
    for pos, count in zip(pads, visual_tokens):
        out.extend(token_ids[start:pos])
        out.extend([IMAGE_PAD_ID] * count)
        start = pos + 1
    out.extend(token_ids[start:])
    return out


def _visual_token_counts(images: Sequence[tuple[str, bytes]], min_pixels: int, max_pixels: int) -> list[int]:
    """<|image_pad|> count of each image, read from its header; MessageError names its part and the image."""
    counts = []
    for k, (param, data) in enumerate(images):
        try:
            counts.append(image_geometry(data, min_pixels, max_pixels).num_tokens)
        except ImageGeometryError as exc:
            raise MessageError(param, f"image {k}: {exc}") from exc
    return counts


def tokenize_rendered(
    rendered: Sequence[RenderedChat], tokenizer: QwenTokenizer
) -> list[PromptInput | ValueError]:
    """Batch-tokenizes rendered chats (one tokenizer call) and expands their image pads. A chat whose
    text spells out its own <|image_pad|> gets a ValueError in its place; the others are unaffected."""
    out: list[PromptInput | ValueError] = []
    for ids, r in zip(tokenizer.encode_batch([r.text for r in rendered]), rendered):
        try:
            out.append(PromptInput(token_ids=expand_image_pads(ids, r.visual_tokens), images=list(r.images)))
        except ValueError as exc:
            out.append(exc)
    return out


def encode_chat(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: QwenTokenizer,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> PromptInput:
    """Messages -> PromptInput ready for the engine; ValueError says what is wrong with the request."""
    (prompt,) = tokenize_rendered([render_chat(messages, min_pixels, max_pixels)], tokenizer)
    if isinstance(prompt, ValueError):
        raise prompt
    return prompt


def prompt_text(messages: Sequence[Mapping[str, Any]], min_pixels: int = MIN_PIXELS,
                max_pixels: int = MAX_PIXELS) -> str:
    """The prompt as text with every image's pads written out (`<|image_pad|>` x N), for debugging."""
    rendered = render_chat(messages, min_pixels, max_pixels)
    counts = rendered.visual_tokens
    pieces = rendered.text.split("<|image_pad|>")
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"prompt has {len(pieces) - 1} <|image_pad|> tokens but {len(counts)} images")
    return pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
