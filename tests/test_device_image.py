"""The GPU image path (workers/inputs/device_image.py, EngineConfig.image_decode "nvjpeg"): the device resize is PIL's
bicubic within one level; prepare_prompt sends RGB and grayscale JPEGs to nvJPEG and every other image, or a JPEG
nvJPEG declines, to PIL; the setting is refused on a CPU engine. On CUDA, nvJPEG's pixels stay within a few levels of
libjpeg's on average."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from contract.types import PromptInput
from workers.inputs import device_image, mm_inputs
from workers.inputs.image_processing import decode_image, resized_pixels

IMAGE_PAD = 151655
LIMIT = 1 << 28


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour regions with noise over them: what a product photo's pixels look like to a resize."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BILINEAR)).astype(np.int16)
    return Image.fromarray(np.clip(smooth + rng.integers(-20, 20, (height, width, 3)), 0, 255).astype(np.uint8))


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, quality=90) if fmt == "JPEG" else image.save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("size,new_size", [((800, 600), (640, 480)), ((700, 1000), (704, 1024)),
                                           ((2001, 3001), (992, 1504)), ((500, 333), (512, 352))],
                         ids=["shrink", "enlarge-one-axis", "shrink-odd", "enlarge"])
def test_the_device_resize_is_pils_bicubic_within_one_level(size, new_size):
    image = photo(*size, seed=size[0])
    want = np.asarray(image.resize(new_size, Image.Resampling.BICUBIC)).astype(int)
    got = device_image.resize_bicubic(torch.from_numpy(np.asarray(image).copy()), new_size[1], new_size[0])
    assert got.dtype == torch.uint8 and tuple(got.shape) == (new_size[1], new_size[0], 3)
    difference = np.abs(got.numpy().astype(int) - want)
    assert difference.max() <= 1  # PIL's 22-bit fixed-point weights against float32
    assert (difference > 0).mean() < 1e-3


def test_the_device_resize_leaves_an_image_of_the_right_size_as_it_is():
    pixels = torch.from_numpy(np.asarray(photo(64, 32)).copy())
    assert device_image.resize_bicubic(pixels, 32, 64) is pixels


def prompt_with(data: bytes, tokens: int) -> PromptInput:
    return PromptInput(token_ids=[1] + [IMAGE_PAD] * tokens + [2], images=[data])


def prepare(data: bytes, tokens: int, decode_device):
    return mm_inputs.prepare_prompt(prompt_with(data, tokens), vocab_size=152064, image_token_id=IMAGE_PAD,
                                    spatial_merge_size=2, min_pixels=1024, max_pixels=1 << 22, max_image_pixels=LIMIT,
                                    decode_device=decode_device)


class Calls(list):
    """The (height, width, device) of each call of the fake decode_resized; declines: it raises, as nvJPEG does on
    a JPEG it does not take."""

    declines = False


@pytest.fixture
def fake_nvjpeg(monkeypatch):
    """decode_resized replaced by a recorder that returns PIL's own pixels (or raises, when told to)."""
    calls = Calls()

    def decode_resized(data, height, width, device):
        calls.append((height, width, device))
        if calls.declines:
            raise RuntimeError("nvJPEG: unsupported JPEG")
        return resized_pixels(decode_image(data, LIMIT))

    monkeypatch.setattr(mm_inputs, "decode_resized", decode_resized)
    return calls


def test_rgb_and_grayscale_jpegs_go_to_nvjpeg_at_their_smart_resized_size(fake_nvjpeg):
    device = torch.device("cuda:1")
    for image in (photo(333, 500), photo(333, 500).convert("L")):
        prepared = prepare(encoded(image, "JPEG"), 160, device)  # 320 x 512 px: 10 x 16 merged tokens
        assert prepared.mm.grid_thw.tolist() == [[1, 32, 20]]
    assert fake_nvjpeg == [(512, 320, device), (512, 320, device)]


@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("JPEG", "CMYK")])
def test_other_images_are_decoded_by_pil(fake_nvjpeg, fmt, mode):
    data = encoded(photo(333, 500).convert(mode), fmt)
    prepared = prepare(data, 160, torch.device("cuda"))
    assert fake_nvjpeg == []
    assert torch.equal(prepared.mm.pixels[0], resized_pixels(decode_image(data, LIMIT)))


def test_a_jpeg_that_nvjpeg_declines_is_decoded_by_pil(fake_nvjpeg):
    fake_nvjpeg.declines = True
    data = encoded(photo(333, 500), "JPEG")
    prepared = prepare(data, 160, torch.device("cuda"))
    assert len(fake_nvjpeg) == 1
    assert torch.equal(prepared.mm.pixels[0], resized_pixels(decode_image(data, LIMIT)))


def test_a_bad_image_is_named_whichever_decoder_is_configured(fake_nvjpeg):
    data = encoded(photo(64, 64), "JPEG")
    with pytest.raises(mm_inputs.PromptError, match="image 0: .*exceeds the limit"):
        mm_inputs.prepare_prompt(prompt_with(data, 16), vocab_size=152064, image_token_id=IMAGE_PAD,
                                 spatial_merge_size=2, min_pixels=1024, max_pixels=1 << 22, max_image_pixels=100,
                                 decode_device=torch.device("cuda"))
    assert fake_nvjpeg == []  # refused from the header, before any decoder ran


def test_nvjpeg_is_refused_on_a_cpu_engine(tmp_path):
    from pydantic import ValidationError

    from workers.config import EngineConfig

    with pytest.raises(ValidationError, match="image_decode 'nvjpeg' decodes on a CUDA device"):
        EngineConfig(checkpoint=tmp_path, image_decode="nvjpeg")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
def test_nvjpegs_pixels_are_libjpegs_within_a_few_levels():
    data = encoded(photo(1000, 750, seed=7), "JPEG")
    want = resized_pixels(decode_image(data, LIMIT))  # 992 x 736
    got = device_image.decode_resized(data, want.shape[0], want.shape[1], torch.device("cuda"))
    assert got.is_pinned() and got.shape == want.shape
    difference = (got.int() - want.int()).abs()
    # not libjpeg's pixels (another IDCT and chroma upsampling: up to ~100 levels at sharp colour edges), yet close on
    # average: 0.6-0.8 levels on catalogue-like photos, ~3.5 on this one's noise of +-20 levels (run79)
    assert 0 < difference.float().mean() < 5.0
