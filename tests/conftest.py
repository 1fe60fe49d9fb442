"""Shared fixtures: tiny checkpoints and a synthetic catalogue, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

import harness  # noqa: F401  - before any test module imports ray: the Rays tests start stay on loopback

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tests"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_moe_checkpoint() -> Path:
    from workers.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(CACHE / "tiny-moe", arch="moe", seed=0)


@pytest.fixture(scope="session")
def tiny_dense_checkpoint() -> Path:
    from workers.tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(CACHE / "tiny-dense", arch="dense", seed=0)


# The FP8 copies use 16x16 scale blocks so that the tiny tensors (64-128 wide) hold several blocks each; the
# released checkpoints use 128x128 (quantization_config.weight_block_size says which).
TINY_FP8_BLOCK = (16, 16)


@pytest.fixture(scope="session")
def tiny_moe_fp8_checkpoint(tiny_moe_checkpoint, tmp_path_factory) -> Path:
    from workers.quantized_checkpoint import quantize_checkpoint

    return quantize_checkpoint(tiny_moe_checkpoint, tmp_path_factory.mktemp("fp8") / "tiny-moe-fp8", TINY_FP8_BLOCK)


@pytest.fixture(scope="session")
def tiny_dense_fp8_checkpoint(tiny_dense_checkpoint, tmp_path_factory) -> Path:
    from workers.quantized_checkpoint import quantize_checkpoint

    return quantize_checkpoint(tiny_dense_checkpoint, tmp_path_factory.mktemp("fp8") / "tiny-dense-fp8", TINY_FP8_BLOCK)
