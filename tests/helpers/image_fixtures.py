"""Test images: random-noise PNGs of a given size, deterministic by seed."""

import base64
import io

import numpy as np
from PIL import Image


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(size: tuple[int, int] = (64, 48)) -> str:
    """A one-colour PNG of `size` as a data URL, as an OpenAI client sends an image."""
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
