"""The HTTP listener's fast lane (router/http_fast_lane.py): keep-alive POSTs to its path answered whole by
`answer`, in order, every other request handed with its connection (and every byte it sent) to the fallback
protocol (aiohttp), a client that goes away cancelling its request."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest
from aiohttp import web

from router import json_codec
from router.http_fast_lane import FastLane, Reply
from tests.helpers.router_fixtures import run

PATH = b"/v1/chat/completions"


def post(body: bytes, path: bytes = PATH, extra: bytes = b"", version: bytes = b"1.1",
         content_type: bytes = b"application/json") -> bytes:
    return (b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
            % (path, version, content_type, len(body), extra) + body)


class Served:
    """A lane on a loopback port whose answer echoes the body, and an aiohttp fallback that says it was aiohttp."""

    def __init__(self, token: str | None = None, max_body: int = 1000, decline: bytes | None = None,
                 ssl_context=None):
        self.answered: list[bytes] = []
        self.fallback_saw: list[tuple[str, str, bytes]] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.decline = decline
        self.token, self.max_body, self.ssl_context = token, max_body, ssl_context

    async def answer(self, body: bytes) -> Reply | None:
        if body == self.decline:
            return None
        if body == b"slow":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        self.answered.append(body)
        return Reply(200, json_codec.dumps({"lane": body.decode()}))

    async def fallback(self, request: web.BaseRequest) -> web.Response:
        body = await request.read()
        self.fallback_saw.append((request.method, request.path, body))
        if len(body) > self.max_body:
            return web.Response(status=413)
        return web.json_response({"aiohttp": body.decode()})

    async def __aenter__(self):
        self.server = web.Server(self.fallback, handler_cancellation=True)
        self.lane = FastLane(PATH, self.answer, self.server, self.max_body, self.token)
        self.listener = await asyncio.get_running_loop().create_server(self.lane, "127.0.0.1", 0,
                                                                          ssl=self.ssl_context)
        self.port = self.listener.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.listener.close()
        self.lane.close()
        await self.server.shutdown(1)

    async def exchange(self, *writes: bytes, replies: int = 1) -> list[tuple[int, dict]]:
        """Write each piece (a short pause between), then read `replies` responses from the connection."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            for piece in writes:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
            return [await read_response(reader) for _ in range(replies)]
        finally:
            writer.close()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict | bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return status, json.loads(body) if headers.get("content-type", "").startswith("application/json") else body


def test_keep_alive_posts_to_its_path_are_answered_by_the_lane_in_order_whatever_the_packets():
    async def main():
        async with Served() as s:
            # one request in pieces (head split, body split), then two pipelined in one write
            one = post(b'"a"')
            replies = await s.exchange(one[:7], one[7:30], one[30:-1], one[-1:], post(b'"b"') + post(b'"c"'),
                                       replies=3)
            assert replies == [(200, {"lane": '"a"'}), (200, {"lane": '"b"'}), (200, {"lane": '"c"'})]
            assert s.answered == [b'"a"', b'"b"', b'"c"'] and s.fallback_saw == []

    run(main())


@pytest.mark.parametrize("request_bytes", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    post(b"x", path=b"/v1/chat/completions?a=1"),
    post(b"x", path=b"/other"),
    post(b"x", version=b"1.0"),
    post(b"x", extra=b"Connection: close\r\n"),
    post(b"x", extra=b"Expect: 100-continue\r\n"),
    post(b"x", content_type=b"application/json; charset=latin-1"),
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    post(b"x" * 1001),  # over max_body: aiohttp's 413
], ids=["get", "query", "other-path", "http-1.0", "close", "expect", "charset", "chunked", "too-large"])
def test_any_other_request_goes_to_aiohttp_with_every_byte_it_sent(request_bytes):
    async def main():
        async with Served() as s:
            status, body = (await s.exchange(request_bytes))[0]
            assert s.answered == [] and len(s.fallback_saw) == 1
            method, path, seen = s.fallback_saw[0]
            assert method == request_bytes.split()[0].decode()
            if path == "/v1/chat/completions" and status == 200:
                assert body == {"aiohttp": seen.decode()} and seen.startswith(b"x")
            if len(seen) > 1000:
                assert status == 413

    run(main())


def test_a_declined_request_and_all_after_it_on_its_connection_go_to_aiohttp():
    async def main():
        async with Served(decline=b'"stream"') as s:
            replies = await s.exchange(post(b'"a"'), post(b'"stream"') + post(b'"b"'), replies=3)
            assert replies == [(200, {"lane": '"a"'}), (200, {"aiohttp": '"stream"'}), (200, {"aiohttp": '"b"'})]

    run(main())


def test_without_httptools_every_request_goes_to_aiohttp(monkeypatch):
    # the GPU image has no httptools: the lane hands each connection to aiohttp at its first request
    import router.http_fast_lane as lane

    monkeypatch.setattr(lane, "httptools", None)

    async def main():
        async with Served() as s:
            replies = await s.exchange(post(b'"a"') + post(b'"b"'), replies=2)
            assert replies == [(200, {"aiohttp": '"a"'}), (200, {"aiohttp": '"b"'})] and s.answered == []

    run(main())


def test_a_token_is_checked_wrong_ones_going_to_aiohttp():
    async def main():
        async with Served(token="sekrit") as s:
            good = await s.exchange(post(b'"a"', extra=b"Authorization: Bearer sekrit\r\n"))
            bad = await s.exchange(post(b'"b"', extra=b"Authorization: Bearer nope\r\n"))
            none = await s.exchange(post(b'"c"'))
            assert good == [(200, {"lane": '"a"'})]
            assert bad == [(200, {"aiohttp": '"b"'})] and none == [(200, {"aiohttp": '"c"'})]

    run(main())


def test_a_client_that_goes_away_cancels_its_request():
    async def main():
        async with Served() as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(post(b"slow"))
            await asyncio.wait_for(s.started.wait(), 5)
            writer.close()
            await asyncio.wait_for(s.cancelled.wait(), 5)
            assert s.lane.connections == set()

    run(main())


def test_the_routers_whole_replies_are_the_same_through_the_lane_and_through_aiohttp():
    from tests.helpers.router_fixtures import Cluster

    async def main():
        config = {"http_listen": "127.0.0.1:0"}
        async with Cluster(config=config) as cluster:
            port, lane = cluster.router.http_port, cluster.router._http._lane
            body = json.dumps({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 7}).encode()
            bad = json.dumps({"messages": [], "max_tokens": 7}).encode()
            answers = []
            for extra in (b"", b"Connection: close\r\n"):  # the lane, then aiohttp
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                answers.append([])
                for payload in (body, bad):
                    writer.write(post(payload, extra=extra))
                    answers[-1].append(await read_response(reader))
                    assert len(lane.connections) == (0 if extra else 1)  # a connection handed over leaves the lane
                    if extra:
                        writer.close()
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
            for reply in answers:
                for field in ("id", "created"):
                    reply[0][1].pop(field)
            assert answers[0] == answers[1]
            assert answers[0][0][0] == 200 and answers[0][0][1]["usage"]["completion_tokens"] == 7
            assert answers[0][1][0] == 400

    run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_over_tls_the_lane_answers_and_hands_a_declined_request_to_aiohttp_on_the_same_connection(tmp_path):
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    client_side = ssl.create_default_context(cafile=str(cert))

    async def main():
        async with Served(decline=b'"stream"', ssl_context=server_side) as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port, ssl=client_side)
            replies = []
            for body in (b'"a"', b'"b"', b'"stream"', b'"c"'):
                writer.write(post(body))
                replies.append(await read_response(reader))
            writer.close()
            assert replies == [(200, {"lane": '"a"'}), (200, {"lane": '"b"'}), (200, {"aiohttp": '"stream"'}),
                               (200, {"aiohttp": '"c"'})]

    run(main())


def test_a_head_longer_than_aiohttps_limit_goes_to_aiohttp_even_when_whole():
    async def main():
        async with Served() as s:
            status, _ = (await s.exchange(post(b'"a"', extra=b"X-Long: " + b"y" * 9000 + b"\r\n")))[0]
            assert s.answered == [] and status == 400  # aiohttp's answer to a field over 8,190 bytes

    run(main())


def test_a_connection_idle_for_the_timeout_is_closed_and_one_in_use_is_not(monkeypatch):
    from router import http_fast_lane

    monkeypatch.setattr(http_fast_lane, "IDLE_TIMEOUT_S", 0.3)

    async def main():
        async with Served() as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            for i in range(6):  # 0.6 s of use, a request every 0.1 s: kept open
                writer.write(post(b'"%d"' % i))
                assert (await read_response(reader))[0] == 200
                await asyncio.sleep(0.1)
            assert len(s.lane.connections) == 1
            await asyncio.sleep(0.8)  # idle past the timeout (and its second look): closed
            assert await asyncio.wait_for(reader.read(), 2) == b"" and s.lane.connections == set()
            writer.close()

    run(main())
