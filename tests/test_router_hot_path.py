"""The router's hot path (issue 35, item 1): no gRPC retry filter on the workers' channels, start-up objects frozen
out of the collector and the young generation collected less often, a reply sent whole decoded once, the
dispatcher's stream run out rather than closed at its final chunk."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc.aio

from contract import transport
from contract.tokenizer import load_tokenizer
from router.completion_text import CompletionText
from router.config import parse_router_config
from router.server import RouterServer
from tests.helpers.router_fixtures import Cluster, run

REPO = Path(__file__).resolve().parent.parent


def test_the_routers_channels_to_workers_have_no_grpc_retries(monkeypatch):
    opened = []

    def insecure_channel(address, options=None, **kwargs):
        opened.append(dict(options))
        return object()

    monkeypatch.setattr(grpc.aio, "insecure_channel", insecure_channel)
    server = RouterServer(parse_router_config({}))
    server.registry._connect("127.0.0.1:1")  # what the registry opens to each worker that registers
    assert opened[-1]["grpc.enable_retries"] == 0
    # other channels (the SUT's to the router, a worker's registration) keep gRPC's default
    assert "grpc.enable_retries" not in dict(transport.channel_options())


def test_the_router_process_freezes_its_start_up_objects_and_collects_the_young_less_often():
    proc = subprocess.Popen([sys.executable, "-m", "router", "--listen", "127.0.0.1:0", "--log-level", "INFO"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "router listening on" in proc.stdout.readline()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if "frozen out of the garbage collector" in line:
                frozen, thresholds = line.split(": ", 1)[1].split("; thresholds ")
                assert int(frozen) > 10_000
                assert thresholds.strip() == "(20000, 20, 20)"
                break
        else:
            raise AssertionError("no freeze reported")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


class _CountingTokenizer:
    def __init__(self):
        self.tok = load_tokenizer()
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self.tok.decode(ids, skip_special_tokens)


def _chunks(tok, text):
    ids = tok.encode(text)
    return [ids[:1], ids[1:5], ids[5:6], ids[6:]]


def test_a_reply_taken_whole_is_decoded_once_into_the_streamed_text():
    counting = _CountingTokenizer()
    text = "Grüße — a mug, 350 ml ✨ 陶瓷马克杯, then more words to spread over chunks 🤖"
    chunks = _chunks(counting.tok, text)
    streamed = CompletionText(counting.tok)
    whole = CompletionText(counting, whole=True)
    for i, ids in enumerate(chunks):
        final = i == len(chunks) - 1
        assert streamed.add(ids, final) is False and whole.add(ids, final) is False
        whole_delta = whole.take(final)
        assert whole_delta == ("" if not final else text)
    assert whole.text == streamed.text == text
    assert whole.num_tokens == streamed.num_tokens == sum(map(len, chunks))
    assert counting.decodes == 1


def test_a_reply_taken_whole_still_drops_a_final_stop_token_and_still_matches_stop_strings():
    counting = _CountingTokenizer()
    ids = counting.tok.encode("one two three four")
    whole = CompletionText(counting, stop_token_ids=[151645], whole=True)
    whole.add(ids[:2], False)
    whole.add(ids[2:] + [151645], True)
    assert (whole.text, whole.stop_reason, whole.num_tokens) == ("one two three four", 151645, len(ids) + 1)
    assert counting.decodes == 1
    # stop strings are matched as the tokens arrive, whole or not
    stopping = CompletionText(counting.tok, stop=["three"], whole=True)
    assert stopping.add(ids, False) is True
    assert (stopping.text, stopping.stop_reason) == ("one two ", "three")


def test_an_http_reply_runs_the_dispatchers_stream_out_leaving_no_generator_to_the_loops_finalizer():
    """Closed at its final chunk, the dispatcher's stream would leave each generator under it (serving, resending,
    the attempt, the worker's call) to the event loop's async-generator finalizer, a task each."""

    async def body():
        async with Cluster(config={"http_listen": "127.0.0.1:0"}) as c:
            finalized = []
            firstiter, finalizer = sys.get_asyncgen_hooks()

            def record(agen):
                finalized.append(agen.ag_code.co_qualname)
                finalizer(agen)

            sys.set_asyncgen_hooks(firstiter, record)  # generators first iterated from here on report to it
            url = f"http://127.0.0.1:{c.router.http_port}/v1/chat/completions"
            async with aiohttp.ClientSession() as session:
                for stream in (False, True, False):
                    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream}
                    async with session.post(url, json=body) as resp:
                        assert resp.status == 200 and await resp.read()
            await asyncio.sleep(0.1)  # the finalizer runs when a generator is collected
            ours = [name for name in finalized if name.startswith(("Dispatcher.", "resend_with_resume", "_Reply."))]
            assert ours == []

    run(body())
