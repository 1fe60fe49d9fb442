"""Pinned staging buffers for a step's host-to-device copies (workers/host_copy.StagingBuffers): values reach their
destination through a named buffer, a step too large for a buffer or a buffer that does not exist is named in the
error, and on CUDA a set of buffers is written again only after the copies that read it have run."""

from __future__ import annotations

import pytest
import torch

from workers.host_copy import StagingBuffers


def buffers(device: str = "cpu", depth: int = 2) -> StagingBuffers:
    return StagingBuffers({"ids": (8, torch.long), "lens": (4, torch.int32)}, torch.device(device), depth=depth)


def test_tensors_and_lists_of_ints_reach_their_destinations_through_the_buffers():
    staging, ids, lens = buffers(), torch.zeros(8, dtype=torch.long), torch.zeros(2, 4, dtype=torch.int32)
    for first in (10, 20, 30):  # three steps: each set of buffers used again
        with staging.step() as stage:
            stage.copy_into("ids", ids[:5], torch.arange(first, first + 5))
            stage.copy_into("lens", lens[1, :3], [first, first + 1, first + 2])
        assert ids.tolist() == [first + i for i in range(5)] + [0, 0, 0]
        assert lens.tolist() == [[0, 0, 0, 0], [first, first + 1, first + 2, 0]]


def test_a_step_larger_than_its_buffer_and_an_unknown_buffer_are_named():
    staging = buffers()
    with staging.step() as stage:
        with pytest.raises(ValueError, match="'lens' holds 4 values; this step has 5"):
            stage.copy_into("lens", torch.zeros(5, dtype=torch.int32), [1, 2, 3, 4, 5])
        with pytest.raises(KeyError, match="no staging buffer 'slots'"):
            stage.copy_into("slots", torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))


def test_a_set_of_buffers_needs_a_depth_of_at_least_one():
    with pytest.raises(ValueError, match="depth 0"):
        buffers(depth=0)


@pytest.mark.gpu
def test_on_cuda_a_set_is_written_again_only_after_the_copies_that_read_it_have_run():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    staging = buffers("cuda", depth=1)  # one set: the second step reuses the first step's buffers at once
    first, second = torch.zeros(8, dtype=torch.long, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda")
    torch.cuda._sleep(200_000_000)  # the stream busy for ~0.1 s: the first step's copy has not run when it returns
    with staging.step() as stage:
        stage.copy_into("ids", first, torch.full((8,), 7))
    with staging.step() as stage:
        stage.copy_into("ids", second, torch.full((8,), 9))
    torch.cuda.synchronize()
    assert first.tolist() == [7] * 8 and second.tolist() == [9] * 8
    assert staging.waits == 1


@pytest.mark.gpu
def test_on_cuda_the_buffers_are_page_locked_and_a_device_tensor_is_copied_directly():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    staging, dst = buffers("cuda"), torch.zeros(8, dtype=torch.long, device="cuda")
    with staging.step() as stage:
        assert all(buf.is_pinned() for buf in stage._buffers.values())
        stage.copy_into("ids", dst, torch.arange(100, 116, device="cuda")[::2])
    assert dst.tolist() == list(range(100, 116, 2))
