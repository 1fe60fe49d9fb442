"""Tensor and expert parallelism across ranks of one instance, and the device-to-device KV hand-off:
greedy tokens equal the single-process engine's (2 gloo ranks on CPU; 2 NCCL ranks in bfloat16 on GPUs)."""

from __future__ import annotations

import concurrent.futures
import gc
import io
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from contract.types import FinishReason, PromptInput, SamplingParams
from workers.config import EngineConfig, KvLinkConfig
from workers.engine import LLMEngine
from workers.kv_cache import KvExport
from workers.request_options import RequestOptions
from workers.serve.kv_transfer import KvLink, KvLinkError
from workers.executor.rank_group import RankStartupError
from workers.model_config import CheckpointError
from lab.soak.process_tree import descendants
from tests.helpers.net_fixtures import listening_sockets
from tests.helpers.scheduler_spies import record_encodes

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
    return LLMEngine.from_config(EngineConfig(checkpoint=checkpoint, **settings))


def generate(engine: LLMEngine) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def exported_kv(engine: LLMEngine) -> KvExport:
    engine.add_request("held", PROMPTS["image"], GREEDY, RequestOptions(prefill_only=True))
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
        engine.add_request("imported", PROMPTS["image"], GREEDY, RequestOptions(kv_import=kv))
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        assert [kv.first_token_id] + out[: len(tokens["image"]) - 1] == tokens["image"]
    finally:
        engine.close()


def test_a_two_rank_instance_listens_on_loopback_only_and_leaves_nothing_behind_once_closed(tiny_moe_checkpoint):
    """The ranks meet through a FileStore in a directory of rank 0's (a TCPStore's server would listen on every
    interface), and their gloo sockets stay on loopback. Closing the instance removes the store's directory; once
    the engine is dropped too (its layers hold the group), this process has the listeners it had."""
    def ours() -> dict[int, str]:
        return {os.getpid(): "rank 0", **descendants(os.getpid())}

    before = set(listening_sockets({os.getpid(): "rank 0"}))
    engine = make(tiny_moe_checkpoint, tensor_parallel_size=2)
    try:
        assert generate(engine)  # the collectives have connected
        listeners = listening_sockets(ours())
        assert [one for one in listeners if not one.loopback] == []
        store = Path(engine.executor.ranks.init_method.removeprefix("file://")).parent
        assert store.is_dir()
    finally:
        engine.close()
    assert not store.exists()
    del engine
    gc.collect()
    assert set(listening_sockets({os.getpid(): "rank 0"})) == before


@pytest.mark.parametrize("split", [True, False], ids=["tower-split", "tower-on-rank-0"])
def test_the_vision_tower_split_over_two_ranks_gives_the_single_process_tokens_whole_and_spread(
        tiny_moe_checkpoint, single, split):
    """engine.vision_tensor_parallel: each rank holds its half of the tower's heads and MLP and runs
    every tower call beside rank 0, whole images and a pass spread over steps alike (an encoder budget below the
    image's cost while other requests run: one block a step); False keeps the whole tower on rank 0."""
    tokens, _ = single
    engine = make(tiny_moe_checkpoint, tensor_parallel_size=2, max_num_encoder_tokens=2, vision_tensor_parallel=split)
    try:
        tower = engine.executor.vision.tower
        heads = tower.module.config.num_heads
        assert tower.num_heads == (heads // 2 if split else heads)
        assert tower.module.blocks[0].attn.qkv.weight.shape[0] == 3 * tower.num_heads * tower.head_dim
        encoded = record_encodes(engine)
        assert generate(engine) == tokens
        depth = engine.scheduler.limits.vision.depth
        assert [what for _, rid, what in encoded if rid == "image"] == [f"blocks {b}-{b}" for b in range(depth)]
        # a request aborted mid-pass (every rank drops its pass), then the same image again from its first block
        engine.add_request("again", PROMPTS["image"], GREEDY)
        engine.add_request("other", PROMPTS["text"], GREEDY)
        for _ in range(20):  # the pass begins in the first step or two
            if any(rid == "again" and what == "blocks 0-0" for _, rid, what in encoded):
                break
            engine.step()
        assert ("again", "blocks 0-0") in {(rid, what) for _, rid, what in encoded}
        engine.abort("again")
        engine.add_request("again", PROMPTS["image"], GREEDY)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert out["again"] == tokens["image"]
    finally:
        engine.close()


def test_a_tower_split_the_ranks_cannot_divide_fails_naming_the_key_before_any_rank_starts(tiny_moe_checkpoint):
    with pytest.raises(CheckpointError, match=r"vision_config.num_heads = 2 is not divisible by tensor_parallel_size 4"):
        make(tiny_moe_checkpoint, tensor_parallel_size=4, vision_tensor_parallel=True)
    assert not torch.distributed.is_initialized()


def test_a_parallel_layout_that_cannot_split_the_kv_heads_fails_naming_the_key(tiny_moe_checkpoint):
    from workers.model.text import Qwen3VLTextForEngine
    from workers.parallel import TensorParallel
    from workers.model_config import CheckpointError, load_model_config

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
    port = _port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each end waits for the other to connect
        sender, receiver = pool.map(lambda role: KvLink(KvLinkConfig("127.0.0.1", port, role, "cpu", timeout_s=60)),
                                    ("prefill", "decode"))
    store = [one for one in listening_sockets({os.getpid(): "both ends"}) if one.port == port]
    assert len(store) == 1 and store[0].loopback  # the prefill side listens at the link's address alone
    try:
        hint = sender.send(kv)
        moved = receiver.receive(hint, kv.num_tokens, kv.first_token_id, timeout_s=60)
        sender.flush()
    finally:
        receiver.close()
    assert torch.equal(moved.stacked(), kv.stacked()) and moved.mrope_position_delta == kv.mrope_position_delta
    engine = make(tiny_moe_checkpoint)
    engine.add_request("moved", PROMPTS["image"], GREEDY, RequestOptions(kv_import=moved))
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert [kv.first_token_id] + out[: len(tokens["image"]) - 1] == tokens["image"]


def test_a_kv_link_whose_address_is_taken_fails_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(KvLinkError, match=rf"kv link 127.0.0.1:{port} \(prefill\): cannot listen there"):
            KvLink(KvLinkConfig("127.0.0.1", port, "prefill", "cpu", timeout_s=5))


def test_a_rank_that_dies_while_starting_fails_the_instance_naming_the_rank_and_phase(tiny_moe_checkpoint, monkeypatch):
    monkeypatch.setenv("Q3VL_RANK_LOG", "NOT-A-LEVEL")  # rank 1's logging.basicConfig raises before it joins
    with pytest.raises(RankStartupError, match=r"rank 1 \(pid \d+\) exited with code 1 in start-up phase 'spawn"):
        make(tiny_moe_checkpoint, tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("expert_parallel,split_tower", [(False, False), (True, False), (False, True)],
                         ids=["tp2", "ep2", "tp2-split-tower"])
def test_two_gpu_ranks_in_bfloat16_give_the_single_gpu_greedy_tokens(tiny_moe_checkpoint, expert_parallel,
                                                                      split_tower):
    # A fixed KV pool: sizing it from free memory would see the reference engine's memory (CUDA graph pools are
    # not returned at once) and differ per rank. Start-up problems of rank 1 surface as RankStartupError or as
    # the rank watcher's log lines (run with -s --log-cli-level=WARNING).
    gpu = dict(device="cuda:0", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8)
    reference = make(tiny_moe_checkpoint, **gpu)
    expected = generate(reference)
    reference.close()
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    engine = make(tiny_moe_checkpoint, **gpu, tensor_parallel_size=2, expert_parallel=expert_parallel,
                  vision_tensor_parallel=split_tower)
    try:
        got = generate(engine)
    finally:
        engine.close()
    # bf16 partial sums are added in another order: the first tokens must agree; log the rest
    for rid in expected:
        assert got[rid][:4] == expected[rid][:4], (rid, got[rid], expected[rid])


def test_two_cpu_ranks_with_an_fp8_cache_gather_and_import_fp8_kv_as_one_rank_does(tiny_moe_checkpoint):
    single_engine = make(tiny_moe_checkpoint, kv_cache_dtype="fp8")
    kv = exported_kv(single_engine)
    engine = make(tiny_moe_checkpoint, tensor_parallel_size=2, kv_cache_dtype="fp8")
    try:
        parallel_kv = exported_kv(engine)  # FP8 shards all-gathered as bytes
        assert parallel_kv.dtype_name == "float8_e4m3fn" and parallel_kv.scales == kv.scales
        # float32 K/V rounded to e4m3 on either side of a tie can land one step apart: compare dequantized
        torch.testing.assert_close(parallel_kv.stacked().float(), kv.stacked().float(), rtol=0.07, atol=2**-9)
        engine.add_request("imported", PROMPTS["image"], GREEDY, RequestOptions(kv_import=kv))  # FP8 rows broadcast as bytes
        while engine.has_unfinished():
            for out in engine.step():
                assert out.finish_reason is not FinishReason.ERROR
    finally:
        engine.close()


def test_kv_link_carries_fp8_kv_and_its_scales_bit_exact():
    from workers.kv_cache import quantize_fp8

    scales = [(0.5, 0.25), (0.125, 2.0)]
    kv = KvExport(5, 7, 3, [quantize_fp8(torch.randn(5, 2, 8), k) for k, _ in scales],
                  [quantize_fp8(torch.randn(5, 2, 8), v) for _, v in scales], scales)
    port = _port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sender, receiver = pool.map(lambda role: KvLink(KvLinkConfig("127.0.0.1", port, role, "cpu", timeout_s=60)),
                                    ("prefill", "decode"))
    try:
        moved = receiver.receive(sender.send(kv), kv.num_tokens, kv.first_token_id, timeout_s=60)
        sender.flush()
    finally:
        receiver.close()
    assert moved.scales == scales and moved.dtype_name == "float8_e4m3fn"
    assert torch.equal(moved.stacked().view(torch.uint8), kv.stacked().view(torch.uint8))
