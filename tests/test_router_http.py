"""The OpenAI-compatible HTTP endpoint, driven by the official `openai` package against instant workers (and, for
guided decoding, a real engine on the tiny checkpoint): what it supports, and what it refuses naming the field."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import grpc
import jsonschema
import openai
import pytest

from contract.chat import encode_chat
from contract.tokenizer import load_tokenizer
from contract.wire import pb
from tests.helpers.image_fixtures import png_data_url
from tests.helpers.router_fixtures import Cluster, collect, request, run, wait_until
from workers.sim.instant_engine import InstantEngine

HTTP = {"http_listen": "127.0.0.1:0"}
MODEL = "Qwen/Qwen3-VL-235B-A22B-Instruct"  # the router's served_model_name


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
            whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
            prompt = encode_chat(MESSAGES, load_tokenizer())
            req = pb.GenerateRequest(request_id="g", prompt_token_ids=prompt.token_ids, images=prompt.images,
                                     sampling=pb.SamplingParams(max_tokens=24))
            tokens, _ = await collect(c.client.generate(req))
            assert whole.choices[0].message.content == load_tokenizer().decode(tokens)
            assert whole.choices[0].finish_reason == "length"
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt.token_ids), 24)
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
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
                await client.chat.completions.create(model=MODEL, messages=remote)
            assert all(e.requests_seen == [] for e in c.engines)
            await client.close()

    run(body())


def test_flood_beyond_admission_gets_http_429():
    async def body():
        limits = {"max_inflight_total": 1, "max_queue": 0}
        async with Cluster(roles=("aggregated",), step_delay_s=0.05, config=HTTP | {"limits": limits}) as c:
            client = openai_client(c)
            # 100,000 tokens at 0.05 s a step: held until closed (50 tokens ended after 2.5 s, which a loaded machine
            # could take to send the next request, and then it got its slot).
            held = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100_000, stream=True)
            await anext(aiter(held))  # the one slot is taken
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
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
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            base = f"http://127.0.0.1:{c.router.http_port}"
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{base}/health") as resp:
                    assert resp.status == 200
                    assert {w["worker_id"] for w in (await resp.json())["workers"]} == {"w0", "w1"}
                async with session.get(f"{base}/metrics") as resp:
                    text = await resp.text()
            for name in ("q3vl_router_time_to_first_token_seconds_count", "q3vl_router_queue_depth",
                         "q3vl_router_worker_inflight{", 'q3vl_router_requests_total{outcome="LENGTH"} 1.0',
                         "q3vl_router_routing_decisions_total{"):
                assert name in text, name
            await client.close()

    run(body())


def metric(text: str, name: str) -> float:
    """A sample's value in the Prometheus text format (the line that starts with `name `)."""
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def test_a_reply_sent_whole_comes_in_one_worker_chunk_and_only_streamed_replies_time_their_first_token():
    async def body():
        async with Cluster(config=HTTP, step_delay_s=0.002) as c:
            chunks = []  # the tokens of every chunk a worker sent the router
            coalesce = type(c.workers[0]).coalesce

            async def counted(self, rid, outputs, interval=1, final_only=False):
                async for chunk in coalesce(self, rid, outputs, interval, final_only):
                    chunks.append(len(chunk.token_ids))
                    yield chunk

            for worker in c.workers:
                worker.coalesce = counted.__get__(worker)
            client = openai_client(c)
            whole = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=12, temperature=0)
            assert chunks == [12] and whole.usage.completion_tokens == 12
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{http_base(c)}/metrics") as resp:
                    text = await resp.text()
            assert metric(text, "q3vl_router_time_to_first_token_seconds_count") == 0
            assert metric(text, "q3vl_router_request_duration_seconds_count") == 1
            stream = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=12, temperature=0,
                                                          stream=True)
            streamed = "".join([e.choices[0].delta.content or "" async for e in stream if e.choices])
            assert streamed == whole.choices[0].message.content
            assert chunks[0] == 12 and len(chunks) >= 3 and sum(chunks[1:]) == 12  # the stream's in several
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{http_base(c)}/metrics") as resp:
                    text = await resp.text()
            assert metric(text, "q3vl_router_time_to_first_token_seconds_count") == 1
            await client.close()

    run(body())


def http_base(cluster: Cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


async def post_chat(cluster: Cluster, body: dict) -> tuple[int, dict]:
    """A raw POST, for bodies the openai package would not send as they are."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{http_base(cluster)}/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.json()


TEXT = [{"role": "user", "content": "Name a product category."}]


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 2.5), ("max_completion_tokens", 0),
    ("temperature", True), ("temperature", -0.5), ("top_p", 0), ("top_p", False), ("top_k", True), ("top_k", -2),
    ("seed", True), ("seed", -1), ("n", True), ("stream", "yes"),
])
def test_bad_numeric_or_boolean_parameters_get_400_naming_the_parameter(field, value):
    async def body():
        async with Cluster(config=HTTP) as c:
            status, reply = await post_chat(c, {"model": MODEL, "messages": TEXT, field: value})
            assert status == 400, reply
            assert reply["error"]["param"] == field and field in reply["error"]["message"]
            assert reply["error"]["type"] == "invalid_request_error"
            assert all(e.requests_seen == [] for e in c.engines)

    run(body())


@pytest.mark.parametrize("field, value", [("temperature", "0.5"), ("top_p", "1"), ("temperature", [0.5])])
def test_a_sampling_number_sent_as_a_string_gets_400_saying_it_must_be_a_number(field, value):
    async def body():
        async with Cluster(config=HTTP) as c:
            status, reply = await post_chat(c, {"model": MODEL, "messages": TEXT, field: value})
            assert status == 400 and reply["error"]["param"] == field
            assert reply["error"]["message"] == f"{field} must be a number, got {json.dumps(value)}"

    run(body())


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("part, problem", [
    (image_part("http://198.51.100.7/cat.jpg"), "remote image URLs are not fetched"),
    (image_part("data:image/png;base64,@@@"), "bad base64"),
    (image_part("data:image/png;base64," + base64.b64encode(b"hello").decode()), "cannot read image header"),
    (image_part("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 30).decode()), ""),
    ({"type": "image_url", "image_url": {}}, "image_url.url is missing"),
])
def test_a_bad_image_gets_400_naming_its_message_part(part, problem):
    async def body():
        async with Cluster(config=HTTP) as c:
            messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
            status, reply = await post_chat(c, {"model": MODEL, "messages": messages})
            assert status == 400, reply
            assert reply["error"]["param"] == "messages[0].content[1].image_url"
            assert reply["error"]["message"].startswith("messages[0].content[1].image_url: ") and problem in \
                reply["error"]["message"]
            assert all(e.requests_seen == [] for e in c.engines)

    run(body())


@pytest.mark.parametrize("messages, param", [
    (["hi"], "messages[0]"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 7}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], "messages[0].content[0]"),
    ([{"role": "system", "content": [image_part(png_data_url())]}, {"role": "user", "content": "hi"}],
     "messages[0].content[0]"),
])
def test_a_bad_message_gets_400_naming_it(messages, param):
    async def body():
        async with Cluster(config=HTTP) as c:
            status, reply = await post_chat(c, {"model": MODEL, "messages": messages})
            assert status == 400, reply
            assert reply["error"]["param"] == param and reply["error"]["message"].startswith(f"{param}: ")

    run(body())


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("logprobs", True), ("top_logprobs", 3), ("presence_penalty", 0.5), ("frequency_penalty", 1),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("logit_bias", {"1": 5}), ("ignore_eos", True),
])
def test_unsupported_parameters_get_400_naming_the_parameter(field, value):
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=4, extra_body={field: value})
            assert caught.value.body["param"] == field and "not supported" in caught.value.body["message"]
            assert all(e.requests_seen == [] for e in c.engines)
            await client.close()

    run(body())


def test_no_op_values_of_unsupported_parameters_are_accepted():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            reply = await client.chat.completions.create(
                model=MODEL, messages=TEXT, max_tokens=3, n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0)
            assert len(reply.choices) == 1 and reply.usage.completion_tokens == 3
            await client.close()

    run(body())


def test_stop_string_ends_the_text_before_it_and_the_worker_stops_streaming_or_not():
    async def body():
        async with Cluster(config=HTTP, step_delay_s=0.005) as c:
            client = openai_client(c)
            free = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=40, temperature=0)
            text = free.choices[0].message.content
            at = len(text) // 3
            stop = text[at:at + 5]  # likely spans a token boundary: the tail must be held back while streaming
            at = text.find(stop)
            for stream in (False, True):
                seen = [len(e.requests_seen) for e in c.engines]
                got = await client.chat.completions.create(
                    model=MODEL, messages=TEXT, max_tokens=2000, temperature=0, stop=["never-in-the-text", stop],
                    stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
                if stream:
                    events = [e async for e in got]
                    content = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
                    finish = [e.choices[0].finish_reason for e in events if e.choices and e.choices[0].finish_reason]
                    usage = events[-1].usage
                else:
                    content, finish, usage = got.choices[0].message.content, [got.choices[0].finish_reason], got.usage
                assert content == text[:at]
                assert finish == ["stop"]
                assert usage.completion_tokens < 40
                # The worker's request was cancelled: it did not run on to 2000 tokens.
                (rid,) = [r for e, n in zip(c.engines, seen) for r in e.requests_seen[n:]]
                await wait_until(lambda: any(rid in e.aborted for e in c.engines), timeout=10.0)
            await client.close()

    run(body())


def test_stop_token_id_ends_generation_without_its_text():
    async def body():
        async with Cluster(config=HTTP) as c:
            prompt = encode_chat(TEXT, load_tokenizer())
            req = pb.GenerateRequest(request_id="g", prompt_token_ids=prompt.token_ids,
                                     sampling=pb.SamplingParams(max_tokens=12))
            tokens, _ = await collect(c.client.generate(req))
            cut = next(i for i in range(4, 12) if tokens[i] not in tokens[:i])
            client = openai_client(c)
            got = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=12, temperature=0,
                                                       extra_body={"stop_token_ids": [tokens[cut]]})
            assert got.choices[0].message.content == load_tokenizer().decode(tokens[:cut])
            assert got.choices[0].finish_reason == "stop"
            assert got.usage.completion_tokens == cut + 1
            await client.close()

    run(body())


def test_prompt_longer_than_max_model_len_or_the_kv_pool_gets_400_naming_the_limit():
    big = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url((4096, 4096))}},
        {"type": "text", "text": "Which category is this?"}]}]

    async def body():
        async with Cluster(config=HTTP, roles=()) as c:
            await c.add_worker("short", max_model_len=512)
            await c.client.wait_for_workers(1, timeout=10)
            client = openai_client(c)
            with pytest.raises(openai.BadRequestError, match=r"maximum context length \(max_model_len\) is 512 tokens"):
                await client.chat.completions.create(model=MODEL, messages=big, max_tokens=4)
            await c.workers[0].stop(0)
            c.workers.clear()
            await c.add_worker("small-pool", engine=InstantEngine(total_kv_blocks=8, block_size=16), kv_block_size=16)
            await wait_until(lambda: [e.worker_id for e in c.router.registry.entries() if e.healthy] == ["small-pool"],
                             timeout=10.0)
            with pytest.raises(openai.BadRequestError, match=r"KV cache of worker small-pool holds \(8 blocks of 16"):
                await client.chat.completions.create(model=MODEL, messages=big, max_tokens=4)
            assert (await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=2)).choices
            await client.close()

    run(body())


def test_models_retrieve_returns_the_model_whose_id_holds_a_slash():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            model = await client.models.retrieve(MODEL)
            assert (model.id, model.object) == (MODEL, "model")
            with pytest.raises(openai.NotFoundError) as caught:
                await client.models.retrieve("Qwen/some-other-model")
            assert caught.value.body == model_not_found("Qwen/some-other-model")
            await client.close()

    run(body())


async def ended_requests(cluster: Cluster) -> tuple[dict[str, float], float]:
    """What /metrics says of ended requests: the request total by outcome, and the duration histogram's count."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{http_base(cluster)}/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    totals = {s.labels["outcome"]: s.value for s in families["q3vl_router_requests"].samples
              if s.name.endswith("_total")}
    [count] = [s.value for s in families["q3vl_router_request_duration_seconds"].samples if s.name.endswith("_count")]
    return totals, count


def test_metrics_count_every_request_that_ends_whatever_ended_it():
    async def body():
        async with Cluster(config=HTTP, step_delay_s=0.01) as c:
            client = openai_client(c)

            async def counted(outcome: str, total: float) -> None:  # some endings are recorded just after the reply
                async def seen():
                    totals, duration_count = await ended_requests(c)
                    return totals.get(outcome) == total and duration_count == sum(totals.values())
                async with asyncio.timeout(10):
                    while not await seen():
                        await asyncio.sleep(0.02)

            free = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=12, temperature=0)
            await counted("LENGTH", 1)
            text = free.choices[0].message.content
            stop = text[len(text) // 2:len(text) // 2 + 3]
            for stream in (False, True):  # a stop string: the router ends the request itself
                got = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=500, temperature=0,
                                                           stop=[stop], stream=stream)
                if stream:
                    _ = [e async for e in got]
            await counted("STOP", 2)
            tokens = load_tokenizer().encode(text)
            await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=12, temperature=0,
                                                 extra_body={"stop_token_ids": [tokens[2]]})  # the worker's EOS
            await counted("STOP", 3)
            held = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=2000, stream=True)
            await anext(aiter(held))
            await held.close()  # the client goes away mid-stream
            await counted("CANCELLED", 1)
            late = request("late", max_tokens=2000, deadline_s=0.2)  # the deadline passes on the worker
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(c.client.generate(late))
            await counted("ERROR", 1)
            totals, duration_count = await ended_requests(c)
            assert totals == {"LENGTH": 1, "STOP": 3, "CANCELLED": 1, "ERROR": 1} and duration_count == 6
            await client.close()

    run(body())


def model_not_found(model: str) -> dict:
    """vLLM's body for a model it does not serve (OpenAIServing._check_model), with OpenAI's error code."""
    return {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model",
            "code": "model_not_found"}


def test_a_chat_request_for_a_model_not_served_gets_404_model_not_found_and_reaches_no_worker():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            for stream in (False, True):
                with pytest.raises(openai.NotFoundError) as caught:
                    await client.chat.completions.create(model="gpt-4", messages=TEXT, max_tokens=4, stream=stream)
                assert caught.value.status_code == 404 and caught.value.body == model_not_found("gpt-4")
            assert all(e.requests_seen == [] for e in c.engines)
            status, reply = await post_chat(c, {"messages": TEXT, "max_tokens": 2})  # no model: the served one
            assert status == 200 and reply["model"] == MODEL
            await client.close()

    run(body())


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "count", "colour"],
    "additionalProperties": False,
}


def test_json_schema_response_from_the_tiny_checkpoint_parses_and_validates(tiny_dense_checkpoint):
    from workers.serve.async_engine import AsyncEngine
    from workers.config import EngineConfig
    from workers.engine import LLMEngine

    engine = AsyncEngine(LLMEngine.from_config(EngineConfig(checkpoint=tiny_dense_checkpoint, num_kv_blocks=64, max_model_len=512)))
    response_format = {"type": "json_schema", "json_schema": {"name": "product", "schema": SCHEMA, "strict": True}}

    async def body():
        # No worker is judged by the clock here: a real engine's first guided step (its grammar built, its first
        # forward) can outlast FAST_HEALTH's 2 s stall bound on a loaded machine, which marked it down mid-request.
        async with Cluster(config=HTTP | {"health": {"heartbeat_interval_s": 0.1, "down_after_s": 600}}, roles=()) as c:
            await c.add_worker("real", engine=engine)
            await c.client.wait_for_workers(1, timeout=10)
            client = openai_client(c)
            for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
                got = await client.chat.completions.create(
                    model=MODEL, messages=TEXT, max_tokens=300, response_format=response_format, **sampling)
                assert got.choices[0].finish_reason == "stop", got.choices[0].message.content
                jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
            free = await client.chat.completions.create(model=MODEL, messages=TEXT, max_tokens=20, temperature=0)
            with pytest.raises(json.JSONDecodeError):  # the random model alone writes no JSON: the grammar did
                json.loads(free.choices[0].message.content)
            await client.close()

    try:
        run(body(), timeout=120)
    finally:
        engine.shutdown()


def test_invalid_json_schema_gets_400_before_any_worker_sees_it():
    async def body():
        async with Cluster(config=HTTP) as c:
            client = openai_client(c)
            bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
            with pytest.raises(openai.BadRequestError, match="Invalid type: strin") as caught:
                await client.chat.completions.create(model=MODEL, messages=TEXT, response_format=bad)
            assert caught.value.body["param"] == "response_format.json_schema.schema"
            assert all(e.requests_seen == [] for e in c.engines)
            await client.close()

    run(body())
