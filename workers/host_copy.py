"""Host-to-device copies that the host does not wait for, so a step's launches run ahead of the GPU.

On CUDA a pageable copy makes the host wait until the stream has drained (PyTorch synchronises after it, and
the driver stages pageable memory through its own buffer); from page-locked memory it is one DMA queued on the
stream. torch's caching host allocator keeps a pinned buffer alive until the copies that read it have run.
"""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t in page-locked memory when it is bound for a CUDA device (t itself if already there); else t."""
    if device.type != "cuda" or t.is_pinned():
        return t
    return t.contiguous().pin_memory()  # an expanded view cannot be pinned in place


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether t is on device ("cuda" means the current CUDA device)."""
    if t.device.type != device.type:
        return False
    if device.type != "cuda":
        return True
    return t.device.index == (device.index if device.index is not None else torch.cuda.current_device())


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src: from the host, on CUDA an asynchronous copy from page-locked memory; a tensor already on
    dst's device is copied there, in stream order."""
    if _on(src, dst.device):
        dst.copy_(src)
        return
    dst.copy_(pinned(src, dst.device), non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on device; on CUDA an asynchronous copy from page-locked memory (the host does not wait for it). A tensor
    already there is returned as it is."""
    if device.type != "cuda" or _on(t, device):
        return t.to(device)
    return pinned(t, device).to(device, non_blocking=True)


def _queued_so_far(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded behind the work queued so far on device's current stream; None off CUDA, where work has run
    by the time it is queued."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HostCopy:
    """A device tensor's copy to page-locked host memory, started at construction. wait() returns the host tensor
    once that copy has run: it waits for the GPU work queued before the copy, not for what is queued after it."""

    def __init__(self, t: torch.Tensor):
        if t.device.type != "cuda":
            self._host, self._done = t, None
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._done = _queued_so_far(t.device)

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host


class QueuedWork:
    """The work queued so far on device's current stream: wait() returns once it has run (at once off CUDA). What a
    step that reads nothing back waits on."""

    def __init__(self, device: torch.device):
        self._done = _queued_so_far(device)

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()
