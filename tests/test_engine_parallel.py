"""Tensor and expert parallelism across ranks of one instance, and the device-to-device KV hand-off:
greedy tokens equal the single-process engine's (2 gloo ranks on CPU; 2 NCCL ranks in bfloat16 on GPUs)."""

from __future__ import annotations

import io
import socket
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_cache import KvExport
from workers.kv_transfer import KvLink, KvLinkConfig
from workers.types import PromptInput, SamplingParams

GREEDY = SamplingParams(max_tokens=8)


def image_prompt() -> PromptInput:
    pixels = np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    # 70x90 with min_pixels 4096 resizes to 64x96: 2 x 3 = 6 visual tokens.
    return PromptInput([151644, 872, 198, 151652] + [151655] * 6 + [151653, 3838, 374, 151645, 198], [buf.getvalue()])


PROMPTS = {
    "image": image_prompt(),
    "text": PromptInput([151644, 872, 198, 3838, 374, 1000, 2000, 3000, 151645, 198]),
    "short": PromptInput([151644, 872, 198, 500, 600]),
}


def make(checkpoint, **kw) -> LLMEngine:
    settings = dict(num_kv_blocks=64, block_size=4, max_model_len=256, min_pixels=4096, max_pixels=65536) | kw
    return LLMEngine(EngineConfig(checkpoint=checkpoint, **settings))


def generate(engine: LLMEngine) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def exported_kv(engine: LLMEngine) -> KvExport:
    engine.add_request("held", PROMPTS["image"], GREEDY, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    kv = engine.export_kv("held")
    engine.release("held")
    return kv


@pytest.fixture(scope="module")
def single(tiny_moe_checkpoint):
    engine = make(tiny_moe_checkpoint)
    return generate(engine), exported_kv(engine)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_cpu_ranks_give_the_single_process_greedy_tokens_and_kv(tiny_moe_checkpoint, single, expert_parallel):
    tokens, kv = single
    engine = make(tiny_moe_checkpoint, tensor_parallel_size=2, expert_parallel=expert_parallel)
    try:
        assert generate(engine) == tokens
        parallel_kv = exported_kv(engine)  # both ranks' KV-head shards, gathered
        assert parallel_kv.num_kv_heads == kv.num_kv_heads
        torch.testing.assert_close(parallel_kv.stacked(), kv.stacked(), rtol=1e-4, atol=1e-5)
        # an imported KV is split over the ranks' caches and decodes on as one engine would
        engine.add_request("imported", PROMPTS["image"], GREEDY, kv_import=kv)
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        assert [kv.first_token_id] + out[: len(tokens["image"]) - 1] == tokens["image"]
    finally:
        engine.close()


def test_a_parallel_layout_that_cannot_split_the_kv_heads_fails_naming_the_key(tiny_moe_checkpoint):
    from workers.model.text import Qwen3VLTextForEngine
    from workers.parallel import TensorParallel
    from workers.weights import CheckpointError, load_model_config

    cfg = load_model_config(tiny_moe_checkpoint).text
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        with torch.device("meta"):
            Qwen3VLTextForEngine(cfg, TensorParallel(0, 4))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kv_link_moves_an_export_to_the_decode_side_which_continues_it_exactly(tiny_moe_checkpoint, single):
    tokens, kv = single
    port, received = _port(), {}

    def decode_side():
        link = KvLink(KvLinkConfig("127.0.0.1", port, "decode", "cpu", timeout_s=60))
        received["kv"] = link.receive(hint_box["hint"].wait_value(), kv.num_tokens, kv.first_token_id,
                                      kv.mrope_position_delta)

    class Box:
        def __init__(self):
            self.event, self.value = threading.Event(), None

        def wait_value(self):
            self.event.wait(60)
            return self.value

    hint_box = {"hint": Box()}
    thread = threading.Thread(target=decode_side)
    thread.start()
    link = KvLink(KvLinkConfig("127.0.0.1", port, "prefill", "cpu", timeout_s=60))
    hint_box["hint"].value = link.hint(kv)
    hint_box["hint"].event.set()
    link.send(kv)
    link.flush()
    thread.join(60)
    moved = received["kv"]
    assert torch.equal(moved.stacked(), kv.stacked())
    engine = make(tiny_moe_checkpoint)
    engine.add_request("moved", PROMPTS["image"], GREEDY, kv_import=moved)
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert [kv.first_token_id] + out[: len(tokens["image"]) - 1] == tokens["image"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_gpu_ranks_in_bfloat16_give_the_single_gpu_greedy_tokens(tiny_moe_checkpoint, expert_parallel):
    reference = make(tiny_moe_checkpoint, device="cuda:0", dtype="bfloat16", num_kv_blocks=None, gpu_memory_utilization=0.3)
    expected = generate(reference)
    del reference
    torch.cuda.empty_cache()
    engine = make(tiny_moe_checkpoint, device="cuda:0", dtype="bfloat16", num_kv_blocks=None,
                  gpu_memory_utilization=0.3, tensor_parallel_size=2, expert_parallel=expert_parallel)
    try:
        got = generate(engine)
    finally:
        engine.close()
    # bf16 partial sums are added in another order: the first tokens must agree; log the rest
    for rid in expected:
        assert got[rid][:4] == expected[rid][:4], (rid, got[rid], expected[rid])
