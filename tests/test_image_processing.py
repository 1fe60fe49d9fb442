"""Image decoding and Qwen3-VL preprocessing: equal to transformers' processor, safe on bad bytes.

Reference: transformers' `Qwen2VLImageProcessorPil` (the PIL/NumPy backend of the Qwen2-VL image processor
that Qwen3-VL uses), configured as Qwen3-VL's preprocessor_config.json. The checkpoint names the
torchvision-backed `Qwen2VLImageProcessorFast`, which cannot load here (no torchvision on this CPU torch);
its bicubic resize differs from PIL's by rounding, so the PIL backend is the one we can match.
Tolerance: none. pixel_values must be bit-for-bit equal (np.array_equal).
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, features

from contract.vision_geometry import MAX_PIXELS, MIN_PIXELS, image_geometry
from workers.inputs.image_processing import (ImageDecodeError, decode_image, merge_block_patches, normalise_patches,
                                             patch_pixels, preprocess, resized_pixels)

Qwen2VLImageProcessorPil = pytest.importorskip(
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
).Qwen2VLImageProcessorPil

LIMIT = 50_000_000


def reference_processor(min_pixels: int = 65536, max_pixels: int = 16777216):
    """transformers' processor with the real Qwen3-VL preprocessor_config.json values."""
    return Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def noise(width: int, height: int, channels: int, seed: int) -> np.ndarray:
    """Smooth-ish random content (noise plus a gradient) so JPEG keeps detail and resizing matters."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 180, width, dtype=np.float32)[None, :, None]
    values = rng.integers(0, 76, (height, width, channels)).astype(np.float32) + ramp
    return values.astype(np.uint8)


def rgba_png(width: int, height: int, seed: int) -> bytes:
    return encode(Image.fromarray(noise(width, height, 4, seed), "RGBA"), "PNG")


def palette_png_with_transparency(width: int, height: int, seed: int) -> bytes:
    image = Image.fromarray(noise(width, height, 3, seed), "RGB").quantize(colors=64)
    return encode(image, "PNG", transparency=0)


def grayscale_jpeg(width: int, height: int, seed: int) -> bytes:
    return encode(Image.fromarray(noise(width, height, 1, seed)[..., 0], "L"), "JPEG", quality=90)


def cmyk_jpeg(width: int, height: int, seed: int) -> bytes:
    image = Image.frombytes("CMYK", (width, height), noise(width, height, 4, seed).tobytes())
    return encode(image, "JPEG", quality=90)


def rgb_jpeg(width: int, height: int, seed: int) -> bytes:
    return encode(Image.fromarray(noise(width, height, 3, seed), "RGB"), "JPEG", quality=85)


def sixteen_bit_png(width: int, height: int, seed: int) -> bytes:
    values = noise(width, height, 1, seed)[..., 0].astype(np.uint16) * 257
    return encode(Image.fromarray(values), "PNG")


def rgba_webp(width: int, height: int, seed: int) -> bytes:
    return encode(Image.fromarray(noise(width, height, 4, seed), "RGBA"), "WEBP", lossless=True)


CASES = [
    pytest.param(rgb_jpeg, 333, 217, id="rgb-jpeg-333x217"),
    pytest.param(rgb_jpeg, 1001, 769, id="rgb-jpeg-1001x769"),
    pytest.param(rgba_png, 97, 401, id="rgba-png-97x401"),
    pytest.param(palette_png_with_transparency, 257, 300, id="palette-transparent-png-257x300"),
    pytest.param(grayscale_jpeg, 640, 481, id="grayscale-jpeg-640x481"),
    pytest.param(cmyk_jpeg, 301, 299, id="cmyk-jpeg-301x299"),
    pytest.param(sixteen_bit_png, 123, 45, id="16bit-png-123x45"),
    pytest.param(rgb_jpeg, 20, 30, id="tiny-jpeg-upscaled-to-min-pixels"),
    pytest.param(
        rgba_webp,
        211,
        173,
        id="rgba-webp-211x173",
        marks=pytest.mark.skipif(not features.check("webp"), reason="Pillow built without WebP"),
    ),
]


@pytest.mark.parametrize("make, width, height", CASES)
def test_preprocess_of_decoded_bytes_equals_transformers_processor(make, width, height):
    data = make(width, height, seed=width)
    expected = reference_processor()(images=[Image.open(io.BytesIO(data))], return_tensors="np")

    pixel_values, grid_thw = preprocess([decode_image(data, LIMIT)])

    assert pixel_values.dtype == torch.float32
    assert grid_thw.tolist() == expected["image_grid_thw"].tolist()
    assert np.array_equal(pixel_values.numpy(), expected["pixel_values"])


def test_preprocess_batch_concatenates_images_in_order_with_custom_pixel_bounds():
    datas = [rgb_jpeg(700, 300, 1), rgba_png(90, 260, 2), grayscale_jpeg(512, 512, 3)]
    bounds = {"min_pixels": 128 * 128, "max_pixels": 256 * 256}
    expected = reference_processor(*bounds.values())(
        images=[Image.open(io.BytesIO(d)) for d in datas], return_tensors="np"
    )

    pixel_values, grid_thw = preprocess([decode_image(d, LIMIT) for d in datas], **bounds)

    assert grid_thw.tolist() == expected["image_grid_thw"].tolist()
    assert pixel_values.shape == (int(grid_thw.prod(dim=1).sum()), 1536)
    assert np.array_equal(pixel_values.numpy(), expected["pixel_values"])


def test_the_engine_keeps_uint8_patches_and_normalises_them_where_they_are_used():
    image = decode_image(rgb_jpeg(700, 300, 1), LIMIT)
    patches, grid_thw = patch_pixels([image])
    pixel_values, _ = preprocess([image])
    assert patches.dtype == torch.uint8 and patches.shape == (int(grid_thw.prod(dim=1).sum()), 3, 256)
    assert patches.nbytes * 8 == pixel_values.nbytes  # one frame of bytes, not two frames of float32
    assert torch.equal(normalise_patches(patches), pixel_values)
    assert torch.equal(normalise_patches(patches[5:9]), pixel_values[5:9])  # row by row: any slice, any batch
    assert torch.equal(normalise_patches(patches, torch.bfloat16), pixel_values.bfloat16())  # rounded once


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_engine_keeps_resized_pixels_and_cuts_them_into_patches_on_the_device(device):
    image = decode_image(rgb_jpeg(700, 300, 1), LIMIT)
    pixels = resized_pixels(image)
    assert pixels.dtype == torch.uint8 and pixels.shape == (288, 704, 3)  # smart_resize: multiples of 32
    want, _ = patch_pixels([image])
    got = merge_block_patches(pixels.to(device))
    assert got.device.type == device and torch.equal(got.cpu(), want)  # a permutation of the same bytes



@pytest.mark.parametrize("width, height", [(333, 217), (1001, 769), (20, 30), (4000, 150)])
def test_header_token_count_equals_processor_grid(width, height):
    data = rgb_jpeg(width, height, seed=7)
    expected = reference_processor()(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    _, grid_h, grid_w = expected["image_grid_thw"][0].tolist()

    geometry = image_geometry(data)

    assert geometry.grid_thw == (1, grid_h, grid_w)
    assert geometry.num_tokens == grid_h * grid_w // 4


def test_decode_returns_rgb_with_alpha_composited_onto_white():
    transparent = np.zeros((40, 50, 4), dtype=np.uint8)  # fully transparent black
    image = decode_image(encode(Image.fromarray(transparent, "RGBA"), "PNG"), LIMIT)
    assert image.mode == "RGB"
    assert image.size == (50, 40)
    assert np.all(np.asarray(image) == 255)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming the given size, with no pixel data behind it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "data, reason",
    [
        pytest.param(b"", "empty", id="zero-bytes"),
        pytest.param(b"definitely not an image", "not a decodable image", id="garbage"),
        pytest.param(png_header_only(0, 10), "not a decodable image", id="zero-width-png"),
        pytest.param(png_header_only(30000, 30000), "pixels", id="30000x30000-png-bomb"),
        pytest.param(png_header_only(5000, 5000), "exceeds the limit", id="over-our-own-limit"),
        pytest.param(png_header_only(64, 64), "cannot decode", id="header-without-pixels"),
    ],
)
def test_decode_rejects_bad_bytes_with_a_reason(data, reason):
    with pytest.raises(ImageDecodeError, match=reason):
        decode_image(data, max_pixels_limit=20_000_000)


@pytest.mark.parametrize("data", [b"definitely not an image", b"\x89PNG\r\n\x1a\nthis is not a png",
                                  png_header_only(64, 64)], ids=["garbage", "png-signature", "header-only"])
def test_a_bad_image_gets_the_same_reason_every_time(data):
    reasons = []
    for _ in range(2):
        with pytest.raises(ImageDecodeError) as info:
            decode_image(data, max_pixels_limit=20_000_000)
        reasons.append(str(info.value))
    assert reasons[0] == reasons[1]
    assert " at 0x" not in reasons[0]


def test_decode_rejects_truncated_jpeg():
    data = rgb_jpeg(300, 200, seed=1)
    with pytest.raises(ImageDecodeError, match="cannot decode JPEG 300x200"):
        decode_image(data[: len(data) // 2], LIMIT)



def test_a_prepared_prompt_carries_each_images_resized_pixels_not_its_patches():
    from contract.types import PromptInput
    from workers.inputs.mm_inputs import prepare_prompt

    data = rgb_jpeg(700, 300, 1)
    pads = image_geometry(data).num_tokens
    prompt = PromptInput([1, 151652, *[151655] * pads, 151653, 2], [data])
    prepared = prepare_prompt(prompt, vocab_size=152064, image_token_id=151655, spatial_merge_size=2,
                              min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_image_pixels=LIMIT)
    (pixels,) = prepared.mm.pixels
    assert pixels.shape == (288, 704, 3) and pixels.dtype == torch.uint8
    assert prepared.mm.grid_thw.tolist() == [[1, 18, 44]]
    assert torch.equal(pixels, resized_pixels(decode_image(data, LIMIT)))
