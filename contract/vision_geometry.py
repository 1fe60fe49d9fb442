"""Image geometry for Qwen3-VL: smart-resize and the number of visual tokens an image becomes.

Torch-free so the harness and the router can size prompts from an image header alone.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

PATCH_SIZE = 16
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # one visual token per 32x32 pixels
MIN_PIXELS = 65536  # preprocessor_config.json size.shortest_edge (a pixel count)
MAX_PIXELS = 16777216  # preprocessor_config.json size.longest_edge (a pixel count)
MAX_ASPECT_RATIO = 200


class ImageGeometryError(ValueError):
    """The image cannot be sized: unreadable header, zero size, or an extreme aspect ratio."""


@dataclass(frozen=True)
class ImageGeometry:
    width: int
    height: int
    resized_width: int
    resized_height: int

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """Patch grid (temporal, rows, cols) in 16-pixel patches, as the vision tower sees it."""
        return (1, self.resized_height // PATCH_SIZE, self.resized_width // PATCH_SIZE)

    @property
    def num_tokens(self) -> int:
        """LLM tokens (<|image_pad|> count) after the 2x2 spatial merge."""
        return (self.resized_height // FACTOR) * (self.resized_width // FACTOR)


def smart_resize(
    height: int,
    width: int,
    factor: int = FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the pixel count kept in
    [min_pixels, max_pixels], as transformers' Qwen2-VL image processor computes it."""
    if height <= 0 or width <= 0:
        raise ImageGeometryError(f"image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageGeometryError(
            f"aspect ratio of {width}x{height} exceeds {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def describe_image_error(exc: BaseException, data: bytes) -> str:
    """Why PIL could not read `data`, in words that are the same on every run: PIL's own messages name its
    file object by memory address (`cannot identify image file <_io.BytesIO object at 0x...>`)."""
    if isinstance(exc, UnidentifiedImageError):
        return f"format not recognised (first bytes: {data[:8].hex(' ') or 'none'})"
    return _OBJECT_REPR.sub("the image data", str(exc)) or type(exc).__name__


def image_geometry(
    data: bytes, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> ImageGeometry:
    """Reads only the header of an encoded image and returns its geometry."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Exception as exc:  # PIL raises many types for bad headers
        raise ImageGeometryError(f"cannot read image header ({len(data)} bytes): "
                                 f"{describe_image_error(exc, data)}") from exc
    rh, rw = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    return ImageGeometry(width=width, height=height, resized_width=rw, resized_height=rh)
