"""The OpenAI-compatible HTTP endpoint, driven by the official `openai` package against instant workers."""

from __future__ import annotations

import base64
import io

import aiohttp
import openai
import pytest
from PIL import Image

from router.wire import pb
from tests.router_fixtures import Cluster, collect, run
from workers.chat import encode_chat
from workers.tokenizer import load_tokenizer

HTTP = {"http_listen": "127.0.0.1:0"}


def png_data_url(size=(64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


MESSAGES = [
    {"role": "system", "content": "You are a product classifier."},
    {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url()}},
        {"type": "text", "text": "Which category is this?"},
    ]},
]


def openai_client(cluster: Cluster, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http_port}/v1", api_key=api_key, max_retries=0)


def test_openai_client_gets_the_same_text_as_the_grpc_path_streaming_or_not():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            whole = await client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=24, temperature=0)
            prompt = encode_chat(MESSAGES, load_tokenizer())
            req = pb.GenerateRequest(request_id="g", prompt_token_ids=prompt.token_ids, images=prompt.images,
                                     sampling=pb.SamplingParams(max_tokens=24))
            tokens, _ = await collect(c.client.generate(req))
            assert whole.choices[0].message.content == load_tokenizer().decode(tokens)
            assert whole.choices[0].finish_reason == "length"
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt.token_ids), 24)
            stream = await client.chat.completions.create(
                model="any", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
            events = [e async for e in stream]
            text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            assert text == whole.choices[0].message.content
            assert [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason] == ["length"]
            assert events[-1].usage.completion_tokens == 24
            await client.close()

    run(body())


def test_remote_image_urls_are_rejected_with_400_and_never_fetched():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            remote = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://198.51.100.7/cat.jpg"}},
                {"type": "text", "text": "what is this"}]}]
            with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
                await client.chat.completions.create(model="any", messages=remote)
            assert all(e.requests_seen == [] for e in c.engines)
            await client.close()

    run(body())


def test_flood_beyond_admission_gets_http_429():
    async def body():
        limits = {"max_inflight_total": 1, "max_queue": 0}
        async with Cluster(roles=("aggregated",), step_delay_s=0.05, config=HTTP | {"limits": limits}) as c:
            client = openai_client(c)
            held = await client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=50, stream=True)
            await anext(aiter(held))  # the one slot is taken
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=5)
            await held.close()
            await client.close()

    run(body())


def test_wrong_api_key_is_refused_when_a_token_is_set():
    async def body():
        async with Cluster(config=HTTP, token="s3cret") as c:
            with pytest.raises(openai.AuthenticationError):
                await openai_client(c, api_key="wrong").models.list()
            models = await openai_client(c, api_key="s3cret").models.list()
            assert [m.id for m in models.data] == ["Qwen/Qwen3-VL-235B-A22B-Instruct"]

    run(body())


def test_health_and_prometheus_metrics_endpoints():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            await client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=4)
            base = f"http://127.0.0.1:{c.router.http_port}"
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{base}/health") as resp:
                    assert resp.status == 200
                    assert {w["worker_id"] for w in (await resp.json())["workers"]} == {"w0", "w1"}
                async with session.get(f"{base}/metrics") as resp:
                    text = await resp.text()
            for name in ("q3vl_router_time_to_first_token_seconds_count 1.0", "q3vl_router_queue_depth",
                         "q3vl_router_worker_inflight{", 'q3vl_router_requests_total{outcome="LENGTH"} 1.0',
                         "q3vl_router_routing_decisions_total{"):
                assert name in text, name
            await client.close()

    run(body())
