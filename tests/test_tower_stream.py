"""The stream a spread tower pass runs on (engine.vision_green_sms): off the GPU there are no streams, and the work
stays where it was; on CUDA the side stream's work comes after the step stream's, and the step stream reads its
outputs only after them."""

from __future__ import annotations

import pytest
import torch

from workers.config import EngineConfig
from workers.core.scheduler import SchedulerLimits
from workers.executor.tower_stream import TowerStream


def test_off_the_gpu_the_passes_stay_on_the_steps_stream():
    stream = TowerStream(torch.device("cpu"), 64)
    x = torch.arange(4.0)
    assert not stream.active and stream.sms == 0
    with stream.beside():
        stream.uses([x])
        y = x * 2
    assert stream.mark() is None
    stream.hand_over(None, [y])
    assert torch.equal(y + 1, x * 2 + 1)


def test_only_a_cuda_engine_schedules_its_passes_as_running_beside_the_steps():
    assert not SchedulerLimits.of(EngineConfig(checkpoint="x")).passes_beside  # the default: on the step's stream
    assert not SchedulerLimits.of(EngineConfig(checkpoint="x", vision_green_sms=64)).passes_beside  # the CPU
    assert SchedulerLimits.of(EngineConfig(checkpoint="x", device="cuda", vision_green_sms=64)).passes_beside


@pytest.mark.gpu
def test_the_steps_stream_reads_side_work_after_it_is_done_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    stream = TowerStream(device, 64)
    assert stream.active
    x = torch.randn(4096, 4096, device=device)
    with stream.beside():
        stream.uses([x])
        y = x
        for _ in range(20):  # long enough that a read without the wait would see an unfinished y
            y = torch.tanh(y @ x) * 0.5
    done = stream.mark()
    stream.hand_over(done, [y])
    got = y.sum().item()
    want = x
    for _ in range(20):
        want = torch.tanh(want @ x) * 0.5
    assert got == pytest.approx(want.sum().item(), rel=1e-4)
    del stream  # its green context goes before x: nothing of x's may be recorded on the context's stream (run140)
    del x
    torch.cuda.synchronize()
