"""Image bytes to vision-tower input: safe decoding to RGB, then Qwen3-VL pixel patches.

Bit-for-bit equal to transformers' PIL-backed Qwen2-VL image processor (used by Qwen3-VL), without torchvision.
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from contract.vision_geometry import (MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, PATCH_SIZE, describe_image_error,
                                     smart_resize)

log = logging.getLogger(__name__)

TEMPORAL_PATCH_SIZE = 2
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1536 values per patch row
IMAGE_MEAN = 0.5  # preprocessor_config.json image_mean / image_std, the same for all channels
IMAGE_STD = 0.5
RESCALE_FACTOR = 1 / 255


class ImageDecodeError(ValueError):
    """The bytes are not an image we will decode: corrupt, empty, zero-sized or too many pixels."""


def _uint8_to_normalised_table() -> np.ndarray:
    """The 256 values a uint8 pixel becomes, computed with transformers' exact arithmetic
    (float64 rescale cast to float32, then float32 (x - mean) / std), so a lookup matches it bit for bit."""
    rescaled = (np.arange(256, dtype=np.float64) * RESCALE_FACTOR).astype(np.float32)
    return (rescaled - np.float32(IMAGE_MEAN)) / np.float32(IMAGE_STD)


_NORMALISED = _uint8_to_normalised_table()


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: transparency is alpha-composited onto white;
    every other mode (palette, grayscale, CMYK, 16-bit) goes through PIL's own `convert("RGB")`."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def open_image(data: bytes, max_pixels_limit: int) -> Image.Image:
    """The image's header, read and checked (format, size, the pixel limit) before any pixel is decoded, so a
    decompression bomb costs nothing."""
    if not data:
        raise ImageDecodeError("image data is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"image has too many pixels: {exc}") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ImageDecodeError(f"not a decodable image ({len(data)} bytes): {describe_image_error(exc, data)}") from exc
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageDecodeError(f"image has zero size ({width}x{height})")
    if width * height > max_pixels_limit:
        raise ImageDecodeError(
            f"image of {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{max_pixels_limit} pixels"
        )
    return image


def load_rgb(image: Image.Image, data: bytes) -> Image.Image:
    """An opened image's pixels decoded (PIL: libjpeg for JPEG) and made RGB (to_rgb)."""
    try:
        image.load()
        return to_rgb(image)
    except Exception as exc:  # truncated data, bad chunks, unsupported codec options
        raise ImageDecodeError(f"cannot decode {image.format or 'image'} {image.width}x{image.height}: "
                               f"{describe_image_error(exc, data)}") from exc


def decode_image(data: bytes, max_pixels_limit: int) -> Image.Image:
    """Decodes encoded image bytes (JPEG, PNG, WebP, or any format PIL reads) to an RGB image: open_image's checks,
    then load_rgb. EXIF orientation is not applied, like transformers and the header-only token count."""
    return load_rgb(open_image(data, max_pixels_limit), data)


def resized_pixels(image: Image.Image, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """One RGB image smart-resized (bicubic, as transformers' PIL path resizes; no copy of the pixels beyond PIL's
    own when the size stays) as uint8 [H, W, 3], H and W multiples of 32: what merge_block_patches cuts, on the host
    or, after one copy, on the device."""
    height, width = smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels)
    if (width, height) != image.size:
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    with warnings.catch_warnings():  # PIL's bytes are read-only; nothing writes these pixels (they are copied out)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(image))


def merge_block_patches(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [H, W, 3] (any device) -> uint8 patches [H/16 * W/16, 3, 256] in 2x2 merge-block order: a permutation
    of the bytes, done where the pixels are (on the GPU one copy kernel; on the host issue 31 measured 117 ms for a
    4,000 px image's patching)."""
    height, width, _ = pixels.shape
    grid_h, grid_w = height // PATCH_SIZE, width // PATCH_SIZE
    blocks = pixels.reshape(grid_h // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE, grid_w // MERGE_SIZE, MERGE_SIZE, PATCH_SIZE, 3)
    # -> (block row, block col, row in block, col in block, channel, patch row, patch col)
    return blocks.permute(0, 3, 1, 4, 6, 2, 5).reshape(grid_h * grid_w, 3, PATCH_SIZE * PATCH_SIZE)


def resized_images(images: Sequence[Image.Image], min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Images -> (each one's resized_pixels after to_rgb, grid_thw int64 [n_images, 3]: one frame of H/16 x W/16
    patches each)."""
    pixels = [resized_pixels(to_rgb(image), min_pixels, max_pixels) for image in images]
    grid_thw = torch.tensor([(1, p.shape[0] // PATCH_SIZE, p.shape[1] // PATCH_SIZE) for p in pixels], dtype=torch.int64)
    return pixels, grid_thw


def patch_pixels(
    images: Sequence[Image.Image], min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images -> (patches uint8 [sum of patches, 3, 256], grid_thw int64 [n_images, 3]) on the host: smart-resized
    (bicubic), cut into 16x16 patches in 2x2 merge-block order, not yet normalised (normalise_patches makes the
    vision tower's rows). The engine keeps resized_pixels and cuts them on the device instead."""
    if not images:
        raise ValueError("preprocess needs at least one image")
    pixels, grid_thw = resized_images(images, min_pixels, max_pixels)
    patches = torch.cat([merge_block_patches(p) for p in pixels])
    log.debug("cut %d images into %d patches", len(pixels), patches.shape[0])
    return patches, grid_thw


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def normalise_patches(patches: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 patches [n, 3, 256] -> the vision tower's rows [n, 1536] in dtype: rescaled 1/255 and normalised with
    mean = std = 0.5 (one table lookup of transformers' exact float32 values, rounded once to dtype), each still
    image its own second frame."""
    key = (patches.device, dtype)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES.setdefault(key, torch.from_numpy(_NORMALISED).to(patches.device, dtype))
    values = table[patches.long()]  # [n, 3, 256]
    return values[:, :, None, :].expand(-1, -1, TEMPORAL_PATCH_SIZE, -1).reshape(patches.shape[0], PATCH_DIM)


def preprocess(
    images: Sequence[Image.Image], min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images -> (pixel_values float32 [sum of patches, 1536], grid_thw int64 [n_images, 3]).

    Smart-resize (bicubic), rescale 1/255, normalise with mean = std = 0.5, patch rows in 2x2 merge
    blocks: what the Qwen3-VL vision tower takes. Non-RGB images are converted with `to_rgb` first.
    """
    patches, grid_thw = patch_pixels(images, min_pixels, max_pixels)
    return normalise_patches(patches), grid_thw
