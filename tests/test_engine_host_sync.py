"""On CUDA a step queues all of its GPU work without the host waiting for the GPU: every host-to-device copy is
asynchronous from page-locked memory, so the one wait of a step is the read-back of its sampled tokens (which
does not wait for the next step's images, queued behind them). So too when the requests sample, as MLPerf's do
(the checkpoint's generation_config.json: temperature 0.7, top-p 0.8, top-k 20), with a seed or without."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from contract.types import PromptInput, SamplingParams
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.host_copy import HostCopy, QueuedWork

pytestmark = pytest.mark.gpu

IMAGE_PAD = 151655
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=6),
    "model-defaults": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=6),
    "seeded": SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=6, seed=11),
}


def image_prompt(seed: int) -> PromptInput:
    pixels = np.random.default_rng(seed).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    # 70x90 with min_pixels 4096 resizes to 64x96: 2 x 3 = 6 visual tokens.
    return PromptInput([151644, 872, 198, 151652] + [IMAGE_PAD] * 6 + [151653, 3838, 374, 151645, 198], [buf.getvalue()])


@contextlib.contextmanager
def sync_debug_mode(mode: str):
    """torch's CUDA sync debug mode `mode` inside ("error": a synchronising CUDA call raises), the mode before it
    after. (Restoring a fixed mode leaked "error" into the tests after these: with overlapped steps a step's wait
    runs after the runner call that launched it has returned, run84.)"""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def erring_on_any_sync(monkeypatch, obj, name: str, record) -> list[str]:
    """obj.name raises on any synchronising CUDA call but the two waits a step may make: HostCopy.wait (its sampled
    tokens' read-back) and QueuedWork.wait (a step that samples nothing: its own work). record sees each call's
    arguments first. Returns the waits made, in order ("tokens", "work")."""
    method, waits = getattr(obj, name), []

    def erring(*args, **kwargs):
        record(*args, **kwargs)
        with sync_debug_mode("error"):
            return method(*args, **kwargs)

    def allowed_to_sync(cls, kind):
        wait = cls.wait

        def wait_allowed_to_sync(self):
            waits.append(kind)
            with sync_debug_mode("default"):
                return wait(self)
        monkeypatch.setattr(cls, "wait", wait_allowed_to_sync)

    monkeypatch.setattr(obj, name, erring)
    allowed_to_sync(HostCopy, "tokens")
    allowed_to_sync(QueuedWork, "work")
    return waits


def warm_cuda_engine(checkpoint, **settings) -> LLMEngine:
    """A small CUDA engine on the tiny checkpoint, after one image request has compiled its kernels and cuDNN plans."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = LLMEngine.from_config(EngineConfig(
        checkpoint=checkpoint, device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=4, max_model_len=256,
        min_pixels=4096, max_pixels=65536, max_num_seqs=4, max_num_batched_tokens=16, **settings,
    ))
    engine.add_request("warm-up", image_prompt(0), SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    return engine


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_steps_wait_for_the_gpu_only_to_read_the_sampled_tokens(tiny_moe_checkpoint, monkeypatch, sampling):
    engine = warm_cuda_engine(tiny_moe_checkpoint)
    assert engine.executor.graphs is not None
    steps, ahead = [], []

    def record(out):
        steps.append(sorted(c.num_tokens for c in out.chunks))
        ahead.append([e.seq.request_id for e in out.encode_ahead])

    erring_on_any_sync(monkeypatch, engine.executor, "execute", record)
    engine.add_request("text", PromptInput([151644, 872, 198, 3838, 374, 419, 151645, 198]), sampling)
    engine.step()
    engine.add_request("image", image_prompt(1), sampling)
    engine.add_request("image-2", image_prompt(2), sampling)  # past the step's 16 tokens
    outputs = {}
    engine.step()
    assert steps[-1] == [1, 15]  # a decode beside an image prompt's prefill (eager, with the vision tower)
    assert ahead[-1] == ["image-2"]  # the next prompt's image, encoded behind the sampled tokens' read-back
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [1, 1, 14] in steps
    assert [1, 1, 1] in steps  # decodes alone (a CUDA graph)
    assert all(outputs[rid] for rid in ("text", "image", "image-2"))


def test_a_step_that_samples_nothing_waits_for_its_own_work(tiny_moe_checkpoint, monkeypatch):
    """A prompt longer than a step's 16 tokens: its first chunk samples nothing, and its step returns only once its
    work has run (else the steps behind it would queue unseen, and their time would count as the next step's)."""
    engine = warm_cuda_engine(tiny_moe_checkpoint)
    steps = []
    waits = erring_on_any_sync(monkeypatch, engine.executor, "execute",
                               lambda out: steps.append(sorted(c.num_tokens for c in out.chunks)))
    engine.add_request("long", PromptInput([151644, 872, 198] + [3838, 374, 419] * 6 + [151645, 198]),
                       SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert steps == [[16], [7], [1]]
    assert waits == ["work", "tokens", "tokens"]


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_overlapped_steps_queue_the_next_step_without_waiting_for_the_running_one(tiny_moe_checkpoint, monkeypatch,
                                                                                  sampling):
    """engine.overlap_decode_steps: launching a step behind a running one (prompt chunks, images, decodes) never waits
    for the GPU, so the host's work for it overlaps the running step; only the read-back of the running step's
    tokens waits."""
    engine = warm_cuda_engine(tiny_moe_checkpoint, overlap_decode_steps=True)
    behind = []

    def record(out, after=None):
        behind.append((after is not None, sorted(c.num_tokens for c in out.chunks)))

    erring_on_any_sync(monkeypatch, engine.executor, "launch", record)
    for rid, prompt in (("text", PromptInput([151644, 872, 198, 3838, 374, 419, 151645, 198])), ("image", image_prompt(1)),
                        ("image-2", image_prompt(2))):
        engine.add_request(rid, prompt, sampling)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert any(queued and max(rows) > 1 for queued, rows in behind)  # prompt rows launched behind a running step
    assert any(queued and rows == [1, 1, 1] for queued, rows in behind)  # decodes alone (a CUDA graph), behind one
    # greedy runs to max_tokens on the tiny checkpoint; a sampled answer may draw an end token sooner
    assert all(len(outputs[rid]) == 6 if sampling.greedy else outputs[rid] for rid in ("text", "image", "image-2"))
