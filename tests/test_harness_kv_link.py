"""The harness's disaggregated layout with workers.kv_link on: a tiny-checkpoint prefill and decode worker as Ray
actors joined by a KvLink (gloo on the CPU, NCCL between two GPUs), the router process between them. Answers equal
the aggregated path's, and the KV of every request the router disaggregated went over the link."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
import yaml

from contract.chat import encode_chat
from contract.tokenizer import load_tokenizer
from contract.transport import call_metadata, open_channel
from contract.types import PromptInput
from contract.wire import pb, pb_grpc
from harness.cluster import Cluster, warmup_prompt
from harness.system_config import (
    CONFIG_DIR,
    ConfigError,
    image_pixel_limits,
    load_system_config,
    parse_system_config,
)
from router.client import RouterClient

MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def linked_tiny_disagg(device: str):
    """cpu-tiny-disagg with the link on; on "cuda" each worker gets one GPU."""
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny-disagg.yaml").read_text())
    data["workers"]["kv_link"] = {"enabled": True, "port": free_port(), "timeout_s": 120}
    if device == "cuda":
        data["engine"]["device"] = "cuda"
        data["ray"]["num_gpus"] = 2
        for pool in data["workers"]["pools"]:
            pool["gpus_per_worker"] = 1
    return parse_system_config(data, f"cpu-tiny-disagg with kv_link on {device}")


TWO_GPUS = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
])


def greedy(rid: str, prompt: PromptInput) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt.token_ids, images=prompt.images,
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


async def tokens(stream) -> list[int]:
    out = []
    async for chunk in stream:
        assert chunk.finish_reason != pb.ERROR, chunk.error
        out.extend(chunk.token_ids)
    return out


async def answers(cluster: Cluster, prompts: dict[str, PromptInput]) -> tuple[dict, dict]:
    """Each prompt through the router (prefill worker, KV over the link, decode worker), and straight to the decode
    worker alone (the aggregated path on the same weights)."""
    async with RouterClient(cluster.router_address, cluster.router_token) as client:
        routed = {name: await tokens(client.generate(greedy(f"routed-{name}", p))) for name, p in prompts.items()}
        listing = await client.list_workers()
    (decode,) = [w.address for w in listing.workers if w.role == pb.DECODE]
    async with open_channel(decode) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        metadata = call_metadata(cluster.router_token)
        alone = {name: await tokens(stub.Generate(greedy(f"alone-{name}", p), metadata=metadata))
                 for name, p in prompts.items()}
    return routed, alone


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", TWO_GPUS])
def test_a_linked_prefill_decode_pair_answers_like_the_aggregated_path_with_every_kv_over_the_link(
        device, tiny_moe_checkpoint, tmp_path):
    config = linked_tiny_disagg(device)
    image = warmup_prompt(*image_pixel_limits(config))
    text = encode_chat([{"role": "user", "content": [{"type": "text", "text": "Name one colour."}]}], load_tokenizer())
    prompts = {"image": image, "text": text}
    with Cluster(config, tiny_moe_checkpoint, tmp_path, ray_address=None, ready_timeout_s=300) as cluster:
        warm = cluster.kv_link_transfers()  # the harness's warm-up request through the router
        routed, alone = asyncio.run(answers(cluster, prompts))
        after = cluster.kv_link_transfers()
    assert warm == {"prefill-0": 1, "decode-0": 1}
    assert after == {"prefill-0": 1 + len(prompts), "decode-0": 1 + len(prompts)}
    assert routed == alone and all(len(t) == MAX_TOKENS for t in routed.values())


def test_a_kv_link_over_more_than_one_prefill_decode_pair_is_rejected_naming_the_key():
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny-disagg.yaml").read_text())
    data["workers"]["kv_link"] = {"enabled": True}
    data["workers"]["pools"][1]["count"] = 2
    with pytest.raises(ConfigError, match=r"workers\.kv_link: .*one prefill and one decode instance.*2 decode"):
        parse_system_config(data, "two-decoders.yaml")


def test_the_two_h200_disaggregated_system_hands_the_kv_over_the_link():
    assert load_system_config("h200x2-disagg").workers.kv_link.enabled
