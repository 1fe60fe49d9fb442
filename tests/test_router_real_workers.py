"""The router in front of real engine workers (tiny checkpoint) running as processes on this machine:
disaggregated = aggregated greedy tokens, a killed worker loses nothing, the OpenAI client sees the same text."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from PIL import Image

from contract.chat import encode_chat
from contract.tokenizer import load_tokenizer
from contract.transport import open_channel
from contract.wire import pb, pb_grpc
from router.client import RouterClient
from tests.helpers.router_fixtures import collect, run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ROUTER_YAML = """
listen: 127.0.0.1:0
http_listen: 127.0.0.1:0
policy: {name: least_loaded, seed: 0}
disaggregation: {enabled: true, min_remote_prefill_tokens: 0}
health: {heartbeat_interval_s: 0.2, down_after_s: 600}
migration: {max_retries: 2}
"""
# down_after_s: no test here waits for a worker's silence (a killed worker's stream fails UNAVAILABLE, which marks it
# down at once); with 1.5 s a live worker whose first step outlasted it on a loaded machine was marked down.


class Processes:
    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str]) -> str:
        """Start `python -m ...` and return its first stdout line (the bound address)."""
        log = open(self.logs / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=os.environ | {"OMP_NUM_THREADS": "1"})
        self.procs[name] = proc
        return proc.stdout.readline().strip()

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def cluster(tiny_dense_checkpoint, tmp_path_factory):
    """A router process (disaggregation on) with one prefill worker and two decode workers."""
    tmp = tmp_path_factory.mktemp("router-real")
    (tmp / "router.yaml").write_text(ROUTER_YAML)
    procs = Processes(tmp)
    try:
        grpc_line = procs.start("router", ["-m", "router", "--config", str(tmp / "router.yaml")])
        address = grpc_line.split()[-1]
        http_port = int(procs.procs["router"].stdout.readline().split(":")[-1])
        workers = {"p0": "prefill", "d0": "decode", "d1": "decode"}
        lines = {}
        for wid, role in workers.items():
            lines[wid] = procs.start(wid, ["-m", "workers.serve.server", "--checkpoint", str(tiny_dense_checkpoint),
                                           "--router", address, "--worker-id", wid, "--role", role])
        addresses = {wid: line.split()[-1] for wid, line in lines.items()}

        async def wait():
            async with RouterClient(address) as client:
                await client.wait_for_workers(3, timeout=60)

        run(wait(), timeout=90)
        yield {"address": address, "http_port": http_port, "workers": addresses, "procs": procs}
    finally:
        procs.stop_all()


def greedy(rid: str, prompt: list[int], max_tokens: int, images=()) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, images=list(images),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def direct(address: str, req: pb.GenerateRequest) -> list[int]:
    """Aggregated reference: the whole request on one worker, no router."""
    async with open_channel(address) as channel:
        tokens, _ = await collect(pb_grpc.WorkerServiceStub(channel).Generate(req))
    return tokens


PROMPT = [151644, 872, 198] + [(i * 131) % 150000 for i in range(60)] + [151645, 198, 151644, 77091, 198]


def test_disaggregated_and_aggregated_greedy_tokens_are_identical(cluster):
    async def body():
        reference = await direct(cluster["workers"]["d0"], greedy("ref", PROMPT, 24))
        async with RouterClient(cluster["address"]) as client:
            tokens, chunks = await collect(client.generate(greedy("pd", PROMPT, 24)))
        assert chunks[0].worker_id == "p0" and chunks[-1].worker_id in {"d0", "d1"}
        assert tokens == reference and len(tokens) == 24

    run(body(), timeout=60)


def png_data_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (20, 120, 200)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


SERVED_MODEL = "Qwen/Qwen3-VL-235B-A22B-Instruct"  # the router's served_model_name: others get 404


def test_openai_client_over_http_gets_the_same_text_as_grpc(cluster):
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url()}},
        {"type": "text", "text": "Describe the product."}]}]

    async def body():
        prompt = encode_chat(messages, load_tokenizer())
        async with RouterClient(cluster["address"]) as client:
            tokens, _ = await collect(client.generate(greedy("img", prompt.token_ids, 16, prompt.images)))
        http = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster['http_port']}/v1", api_key="x", max_retries=0)
        reply = await http.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=16,
                                                  temperature=0)
        await http.close()
        assert reply.choices[0].message.content == load_tokenizer().decode(tokens)
        assert reply.usage.prompt_tokens == len(prompt.token_ids)

    run(body(), timeout=60)


def test_a_worker_killed_mid_stream_loses_and_repeats_no_token(cluster):
    async def body():
        reference = await direct(cluster["workers"]["d1"], greedy("ref-long", PROMPT, 120))
        async with RouterClient(cluster["address"]) as client:
            stream = client.generate(greedy("killed", PROMPT, 120))
            streamed, victim = [], None
            async for chunk in stream:
                streamed.extend(chunk.token_ids)
                if chunk.worker_id.startswith("d") and victim is None:
                    victim = chunk.worker_id
                    cluster["procs"].kill(victim)
            listing = await client.list_workers()
        assert victim is not None
        assert streamed == reference
        assert dict(zip([w.worker_id for w in listing.workers], listing.healthy))[victim] is False

    run(body(), timeout=90)
