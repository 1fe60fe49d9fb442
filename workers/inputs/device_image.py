"""JPEG bytes to the tower's smart-resized uint8 pixels on a CUDA device (EngineConfig.image_decode "nvjpeg"): nvJPEG
decodes (torchvision.io.decode_jpeg on CUDA, imported only on this path: the CPU install has no torchvision), and a
bicubic resize on the device follows PIL's.

PIL's bicubic resize of an 8-bit image (Pillow's src/libImaging/Resample.c) filters with a = -0.5 and, when it
shrinks, widens the filter's support by the scale (antialiasing); it runs the horizontal pass first and rounds it to
8 bits before the vertical pass. torch's `interpolate(..., mode="bicubic", antialias=True)` computes the same weights
(it was written to follow PIL: https://github.com/pytorch/pytorch/pull/65142), so `resize_bicubic` runs it one axis
at a time, in float32, rounding in between as PIL does. What is left is PIL's fixed-point arithmetic (22-bit
weights): tests/test_device_image.py bounds the difference at one level in a few pixels.

nvJPEG's IDCT and chroma upsampling are not libjpeg's, so its pixels differ from PIL's by a few levels; the bench
(scripts/bench_image_path.py) measures by how much, and what that does to the tower's outputs. "pil" stays the
default: it is what transformers' processor computes.

The pixels come back to page-locked host memory (a few ms for a 4,000 px image), where the "pil" path leaves them
too: a device-resident copy of every queued image could hold gigabytes of GPU memory in Offline, where LoadGen issues
every query at once.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

JPEG_MAGIC = b"\xff\xd8\xff"
_streams = threading.local()  # one CUDA stream per preparation thread, so they do not wait on the engine's


def is_jpeg(data: bytes) -> bool:
    return data[:3] == JPEG_MAGIC


def resize_bicubic(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, 3] on any device -> uint8 [height, width, 3] on the same device: PIL's bicubic (antialiased when
    shrinking), horizontal pass first, each pass rounded half up and clamped to 0-255 as PIL's 8-bit passes are."""
    h, w, _ = pixels.shape
    if (h, w) == (height, width):
        return pixels
    x = pixels.permute(2, 0, 1)[None].float()  # [1, 3, H, W]
    if w != width:
        x = _rounded(F.interpolate(x, size=(h, width), mode="bicubic", antialias=True, align_corners=False))
    if h != height:
        x = _rounded(F.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False))
    return x[0].permute(1, 2, 0).to(torch.uint8).contiguous()


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.floor_(x.add_(0.5)).clamp_(0.0, 255.0)


def _stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream on device (made on first use)."""
    streams = _streams.__dict__.setdefault("by_device", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def decode_on_device(data: bytes, height: int, width: int, device: torch.device) -> torch.Tensor:
    """A JPEG's RGB pixels decoded by nvJPEG on device and resized there to height x width (resize_bicubic): uint8
    [height, width, 3] on device, queued on the current stream. Raises RuntimeError where nvJPEG does not take the
    file."""
    from torchvision.io import ImageReadMode, decode_jpeg  # GPU image only

    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    chw = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    return resize_bicubic(chw.permute(1, 2, 0), height, width)


def decode_resized(data: bytes, height: int, width: int, device: torch.device) -> torch.Tensor:
    """decode_on_device on this thread's own stream, returned as uint8 [height, width, 3] in page-locked host memory
    once the copy has run. Raises RuntimeError where nvJPEG does not take the file (the caller decodes it with PIL
    instead)."""
    stream = _stream(device)
    with torch.cuda.stream(stream):
        pixels = decode_on_device(data, height, width, device)
        host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(pixels, non_blocking=True)
    stream.synchronize()
    return host
