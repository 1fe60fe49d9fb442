"""Where the vision tower's large passes run: on the step's own stream (the default), or on the stream of a CUDA
green context holding some of the GPU's SMs (EngineConfig.vision_green_sms), beside the text tower's steps.

On one stream a pass spread over steps adds its blocks to each step's time, and the decodes beside it wait for them.
On a plain second stream the tower's blocks take every SM and the decode steps stall for the whole pass (run129:
210-637 ms a step). Confined to a green context the blocks run slower and the steps go on beside them: with 64 of an
H100's 132 SMs, 32 requests decoded at 1.4x their step time while a 4,000 px pass took 2.0x as long, the two
together 0.85x of one after the other (benchmarks/README.md, thirty-eighth and thirty-ninth passes, run129-139).

The scheduler lists such a pass whole; the model runner queues it on the side stream and reports it done once its
event has passed (ModelRunner.finished_passes), and only then does a step read its outputs (after waiting for the
event all the same). Outputs read on the step's stream have that use recorded (Tensor.record_stream), so the caching
allocator does not hand their memory on early. Inputs the side stream reads are held instead until its work on them
is done: a use recorded on a green context's stream makes the allocator record events there when the tensor is
freed, which aborts the process once the context is gone (run140: "CUDA error: context is destroyed" from
CUDACachingAllocator's insert_events, at exit).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def green_stream(num_sms: int, device: torch.device) -> tuple[torch.cuda.Stream, object]:
    """A stream of a new green context of num_sms SMs on device, with the context (keep it alive while the stream is
    used). Raises RuntimeError where this torch cannot."""
    try:
        from torch.cuda import green_contexts
    except ImportError as exc:
        raise RuntimeError(f"this torch ({torch.__version__}) has no torch.cuda.green_contexts") from exc
    if not getattr(green_contexts, "SUPPORTED", True):
        raise RuntimeError(f"this torch ({torch.__version__}) was built without green contexts")
    index = device.index if device.index is not None else torch.cuda.current_device()
    context = green_contexts.GreenContext.create(num_sms=num_sms, device_id=index)
    if not hasattr(context, "Stream"):
        raise RuntimeError(f"this torch's ({torch.__version__}) GreenContext has no Stream(): its work could only "
                           "run with the context made current, which makes the engine's stream wait for it")
    return context.Stream(), context


class TowerStream:
    """The spread passes' stream: a green context's of `sms` SMs on CUDA, else none (the work stays on the step's
    stream, as off the GPU, where there are no streams)."""

    def __init__(self, device: torch.device, sms: int):
        self.device = device
        self.sms = sms if device.type == "cuda" else 0
        self.stream, self._context = green_stream(self.sms, device) if self.sms else (None, None)
        self._inputs: list[torch.Tensor] = []  # read by side work queued since the last mark
        self._held: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []  # until the side stream passes the event

    @property
    def active(self) -> bool:
        return self.stream is not None

    @contextmanager
    def beside(self) -> Iterator[None]:
        """Runs the body's work on the side stream, after the step's stream's work so far (which made its inputs:
        pass them to `uses`)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def uses(self, tensors: list[torch.Tensor]) -> None:
        """Tensors the step's stream made that the side stream's work reads: held until the side stream has passed
        the next mark, wherever the host drops them."""
        if self.stream is not None:
            self._inputs.extend(tensors)

    def mark(self) -> torch.cuda.Event | None:
        """An event after the side stream's work so far (none without a side stream); the inputs of the work before
        it are let go once the side stream has passed it."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        self._held = [(e, held) for e, held in self._held if not e.query()]
        if self._inputs:
            self._held.append((event, self._inputs))
            self._inputs = []
        return event

    def hand_over(self, event: torch.cuda.Event | None, outputs: list[torch.Tensor]) -> None:
        """The step's stream waits for event before reading outputs made on the side stream, and their memory stays
        theirs until the step's stream is done with them."""
        if event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        for tensor in outputs:
            tensor.record_stream(stream)
