"""The vision tower's own pieces: the patch embedding run as a GEMM equals transformers' Conv3d, and images of
equal size are planned into one attention run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.model.vision import PatchLinear, frame_runs


def patch_conv(channels: int = 3, temporal: int = 2, patch: int = 16, out: int = 64) -> nn.Conv3d:
    torch.manual_seed(0)
    kernel = (temporal, patch, patch)
    return nn.Conv3d(channels, out, kernel_size=kernel, stride=kernel, bias=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_patch_linear_gives_the_convolutions_output(dtype, tol):
    conv = patch_conv().to(dtype)
    patches = torch.randn(37, 3, 2, 16, 16, dtype=dtype)
    expected = conv(patches)
    got = PatchLinear(conv)(patches)
    assert got.shape == expected.shape == (37, 64, 1, 1, 1)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_patch_linear_shares_the_checkpoint_tensors():
    conv = patch_conv()
    linear = PatchLinear(conv)
    assert linear.weight is conv.weight and linear.bias is conv.bias


def test_an_overlapping_convolution_is_refused():
    conv = nn.Conv3d(3, 8, kernel_size=(2, 16, 16), stride=(2, 8, 8))
    with pytest.raises(ValueError, match="not a non-overlapping patch projection"):
        PatchLinear(conv)


def test_consecutive_frames_of_one_size_form_one_run():
    grid = torch.tensor([[1, 4, 4], [1, 4, 4], [1, 2, 6], [2, 4, 4]])
    assert frame_runs(grid) == [(16, 2), (12, 1), (16, 2)]
