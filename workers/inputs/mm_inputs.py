"""Turns a PromptInput into what the model needs: image patches, visual-token rows, MRoPE positions.

Validates the prompt (token ids in range, <|image_pad|> runs matching each image's visual token count).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from contract.tokenizer import token_runs
from contract.types import PromptInput
from contract.vision_geometry import PATCH_SIZE, ImageGeometryError, smart_resize
from workers.inputs.device_image import decode_resized, is_jpeg
from workers.inputs.image_processing import ImageDecodeError, load_rgb, open_image, resized_pixels
from workers.kv_cache import ImageLayout

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """The prompt cannot be served; the message says why."""


@dataclass
class MultiModalInput:
    positions: torch.Tensor  # [3, prompt_len] int64 MRoPE positions of the prompt
    # per image its smart-resized uint8 [H, W, 3]: cut into patches (merge_block_patches) and normalised into the
    # tower's rows on the device, so the host only decodes and resizes
    pixels: list[torch.Tensor]
    grid_thw: torch.Tensor | None  # [images, 3] int64


@dataclass
class PreparedPrompt:
    mm: MultiModalInput | None  # None for a text-only prompt (positions are then 1-D), or one laid out from a KV import
    mrope_position_delta: int
    image_spans: list[tuple[int, int, bytes]]  # (first index, token count, content digest) per image
    image_layout: tuple[ImageLayout, ...] = ()  # per image its visual-token grid and digest (what a KV export carries)


def _image_spans(token_ids: list[int], image_token_id: int, counts: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each image's <|image_pad|> run; each image's tokens must be one contiguous run."""
    runs = token_runs(token_ids, image_token_id)
    pads = sum(length for _, length in runs)
    if pads != sum(counts):
        raise PromptError(
            f"prompt has {pads} <|image_pad|> tokens but its {len(counts)} image(s) need "
            f"{sum(counts)} ({'+'.join(map(str, counts)) or '0'})"
        )
    spans, run, used = [], 0, 0  # images written back to back share a run: `used` of runs[run] is taken
    for n, count in enumerate(counts):
        start, length = runs[run]
        if used + count > length:
            raise PromptError(f"the {count} <|image_pad|> tokens of image {n} are not one contiguous run")
        spans.append((start + used, count))
        used += count
        if used == length:
            run, used = run + 1, 0
    return spans


def mrope_delta(prompt_len: int, spans: list[tuple[int, int]], grids: list[tuple[int, int]]) -> int:
    """The delta mrope_positions returns, from the layout alone: an image of gh * gw tokens advances the positions by
    max(gh, gw), text by one a token, so they end sum(max(gh, gw) - gh * gw) past the token indices."""
    return sum(max(gh, gw) - gh * gw for gh, gw in grids[: len(spans)])


def mrope_positions(
    prompt_len: int, spans: list[tuple[int, int]], grids: list[tuple[int, int]]
) -> tuple[torch.Tensor, int]:
    """MRoPE positions [3, prompt_len] and the delta that continues them (transformers' get_rope_index).

    Text advances all three axes by one per token; an image of (gh, gw) merged tokens starting at
    position s gets (s, s + row, s + col), and the text after it resumes at s + max(gh, gw)."""
    parts, cur, prev = [], 0, 0
    for (start, _length), (gh, gw) in zip(spans, grids):
        if start > prev:
            parts.append(torch.arange(cur, cur + start - prev).expand(3, -1))
            cur += start - prev
        rows = torch.arange(gh).repeat_interleave(gw)
        cols = torch.arange(gw).repeat(gh)
        parts.append(torch.stack([torch.zeros_like(rows), rows, cols]) + cur)
        cur += max(gh, gw)
        prev = start + gh * gw
    if prompt_len > prev:
        parts.append(torch.arange(cur, cur + prompt_len - prev).expand(3, -1))
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - prompt_len


def _image_pixels(n: int, data: bytes, min_pixels: int, max_pixels: int, max_image_pixels: int,
                  decode_device: torch.device | None) -> torch.Tensor:
    """Image n's smart-resized uint8 [H, W, 3]: by nvJPEG on decode_device where it takes the image (an RGB or
    grayscale JPEG), else by PIL. PromptError names the image and what is wrong with it."""
    try:
        image = open_image(data, max_image_pixels)
        height, width = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels)
        if decode_device is not None and is_jpeg(data) and image.mode in ("RGB", "L"):
            try:
                return decode_resized(data, height, width, decode_device)
            except RuntimeError as exc:  # a JPEG variant nvJPEG does not take: libjpeg decodes it
                log.debug("image %d: nvJPEG declined it (%s); decoding with PIL", n, exc)
        return resized_pixels(load_rgb(image, data), min_pixels, max_pixels)
    except (ImageDecodeError, ImageGeometryError) as exc:
        raise PromptError(f"image {n}: {exc}") from exc


def prepare_prompt(
    prompt: PromptInput,
    *,
    vocab_size: int,
    image_token_id: int,
    spatial_merge_size: int,
    min_pixels: int,
    max_pixels: int,
    max_image_pixels: int,
    decode_device: torch.device | None = None,
) -> PreparedPrompt:
    """Decodes and preprocesses the images and lays out the prompt; raises PromptError with the reason.
    decode_device: a CUDA device on which nvJPEG decodes and resizes the JPEG images it takes (device_image.py);
    None decodes every image with PIL."""
    ids = prompt.token_ids
    if not ids:
        raise PromptError("prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not prompt.images:
        _image_spans(ids, image_token_id, [])
        return PreparedPrompt(mm=None, mrope_position_delta=0, image_spans=[])
    pixels = [_image_pixels(n, data, min_pixels, max_pixels, max_image_pixels, decode_device)
              for n, data in enumerate(prompt.images)]
    grid_thw = torch.tensor([(1, p.shape[0] // PATCH_SIZE, p.shape[1] // PATCH_SIZE) for p in pixels],
                            dtype=torch.int64)
    grids = [(int(h) // spatial_merge_size, int(w) // spatial_merge_size) for _, h, w in grid_thw.tolist()]
    spans = _image_spans(ids, image_token_id, [gh * gw for gh, gw in grids])
    positions, delta = mrope_positions(len(ids), spans, grids)
    digests = [hashlib.blake2b(data, digest_size=16).digest() for data in prompt.images]
    return PreparedPrompt(
        mm=MultiModalInput(positions=positions, pixels=pixels, grid_thw=grid_thw),
        mrope_position_delta=delta,
        image_spans=[(s, n, d) for (s, n), d in zip(spans, digests)],
        image_layout=tuple(ImageLayout(gh, gw, d) for (gh, gw), d in zip(grids, digests)),
    )


def layout_imported_prompt(token_ids: list[int], layout: tuple[ImageLayout, ...], *, vocab_size: int,
                           image_token_id: int) -> PreparedPrompt:
    """The prompt of a KV import sent without its images (a decode worker's): checked as prepare_prompt checks one
    (token ids in range, each image's <|image_pad|> run as long as its grid says) and laid out from the images'
    grids, never their pixels. Its MRoPE delta is what the KV must carry; mm is None (the KV holds the prompt, and
    such a prompt cannot be computed again here)."""
    if not token_ids:
        raise PromptError("prompt is empty")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    grids = [(image.grid_rows, image.grid_cols) for image in layout]
    spans = _image_spans(token_ids, image_token_id, [gh * gw for gh, gw in grids])
    return PreparedPrompt(
        mm=None,
        mrope_position_delta=mrope_delta(len(token_ids), spans, grids),
        image_spans=[(s, n, image.digest) for (s, n), image in zip(spans, layout)],
        image_layout=tuple(layout),
    )
