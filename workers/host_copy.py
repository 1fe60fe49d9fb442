"""Host-to-device copies that the host does not wait for, so a step's launches run ahead of the GPU.

On CUDA a pageable copy makes the host wait until the stream has drained (PyTorch synchronises after it, and
the driver stages pageable memory through its own buffer); from page-locked memory it is one DMA queued on the
stream. torch's caching host allocator keeps a pinned buffer alive until the copies that read it have run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
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


class StagingBuffers:
    """Page-locked host buffers, made once, that a step's host-to-device copies read from.

    copy_into pins a fresh tensor on every call (aten::is_pinned and aten::pin_memory took ~0.1 ms a tensor on an
    H100's host, five tensors a decode step: benchmarks/README.md, run146's profile); a staged copy is a memcpy into
    a buffer that is already pinned, then the same asynchronous copy. `depth` sets of buffers are used in turn, one a
    step, and a set is written again only once the copies that read it have run. Two sets cover an engine whose
    steps wait for their sampled tokens, with or without overlap: by the time a set comes round again the step that
    used it has sampled, so its copies have run and no wait is made.

    Off CUDA the buffers are ordinary memory and the copies run at once (the same path, so the CPU tests take it).
    """

    def __init__(self, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device, depth: int = 2):
        if depth < 1:
            raise ValueError(f"staging depth {depth}: need at least one set of buffers")
        cuda = device.type == "cuda"
        self._sets = [{name: torch.empty(n, dtype=dtype, pin_memory=cuda) for name, (n, dtype) in sizes.items()}
                      for _ in range(depth)]
        # a set's copies have run once its event has (an event never recorded counts as run: query() is True)
        self._read: list[torch.cuda.Event | None] = [torch.cuda.Event() if cuda else None for _ in range(depth)]
        self._turn = 0
        self.waits = 0  # steps that found their set still being read (a wait on the GPU); 0 expected

    @contextmanager
    def step(self) -> Iterator[StagedCopies]:
        """The next set of buffers, once the copies that last read it have run; on leaving, the point in the
        current stream after which its copies have run is recorded."""
        turn, event = self._turn, self._read[self._turn]
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        yield StagedCopies(self._sets[turn])
        if event is not None:
            event.record()
        self._turn = (turn + 1) % len(self._sets)


class StagedCopies:
    """One step's copies through one set of staging buffers (StagingBuffers.step)."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self._buffers = buffers

    def _staged(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            raise KeyError(f"no staging buffer {name!r} (there are {sorted(self._buffers)})")
        n = int(np.prod(shape))
        if n > buf.numel():
            raise ValueError(f"staging buffer {name!r} holds {buf.numel()} values; this step has {n}")
        return buf[:n].view(shape)

    def copy_into(self, name: str, dst: torch.Tensor, src: torch.Tensor | Sequence[int]) -> None:
        """dst[...] = src through buffer `name`: src a host tensor or a sequence of ints; a tensor already on dst's
        device (not the host) is copied there directly, in stream order."""
        if isinstance(src, torch.Tensor):
            if src.device.type != "cpu":
                dst.copy_(src)
                return
            staged = self._staged(name, tuple(src.shape))
            staged.copy_(src)
        else:
            staged = self._staged(name, (len(src),))
            staged.numpy()[:] = src
        dst.copy_(staged, non_blocking=dst.device.type == "cuda")
