"""The HTTP listener's fast lane: plain keep-alive POSTs to one path answered whole on an asyncio.Protocol, every
other request handed, with its connection, to aiohttp.

aiohttp's server spends about as much CPU a request as the rest of the front end's own Python (its request and
response objects, routing, a task per connection's request loop); the router's hot path is one kind of request, a
chat completion sent whole. This lane frames such a request itself (the head up to its blank line, parsed by
httptools, https://github.com/MagicStack/httptools; then Content-Length bytes of body), calls `answer(body)` and
writes the reply as one write.

What it takes is only what it answers as aiohttp would: an HTTP/1.1 POST to exactly `path` that keeps the connection
alive, with a Content-Length of at most `max_body` bytes, no Transfer-Encoding, Expect or Upgrade, a UTF-8 (or
unnamed) charset and, when a token is set, the right bearer token. Anything else (another path or method, a
malformed head, a body over the limit, a refused token) and any request `answer` declines (returns None: a stream)
goes to aiohttp's protocol (`fallback()`, the AppRunner's server) with every byte of it and of what followed it, and
the connection stays with aiohttp from then on. So errors, streams and the other endpoints are aiohttp's, unchanged.

Requests on one connection are answered one at a time, in order (as aiohttp does). A client that goes away cancels
its request's task (aiohttp's handler_cancellation), which cancels the worker's request. An idle connection is
closed after IDLE_TIMEOUT_S, as aiohttp's keepalive_timeout closes its own.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any

try:
    import httptools
except ImportError:  # an install without it (the GPU image has none): every request goes to aiohttp
    httptools = None
from aiohttp.http import SERVER_SOFTWARE

from contract.transport import bearer_ok

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 75.0  # aiohttp's keepalive_timeout
MAX_HEAD_BYTES = 8_190  # a longer head is aiohttp's to judge (its limit on a line and on a field)
_CHARSETS = (b"utf-8", b"utf8")


class Reply:
    """What `answer` returns: a status and a UTF-8 JSON body."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body


class _Head:
    """httptools' callbacks for one request head: its URL and headers (lower-cased names; a repeated one is None)."""

    __slots__ = ("url", "headers", "complete")

    def __init__(self):
        self.url = b""
        self.headers: dict[bytes, bytes | None] = {}
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.headers[name] = None if name in self.headers else value

    def on_headers_complete(self) -> None:
        self.complete = True


class FastLane:
    """The listener's protocol factory (loop.create_server(lane, ...))."""

    def __init__(self, path: bytes, answer: Callable[[bytes], Awaitable[Reply | None]],
                 fallback: Callable[[], asyncio.Protocol], max_body: int, token: str | None = None):
        self.path = path
        self.answer = answer
        self.fallback = fallback
        self.max_body = max_body
        self.token = token
        self.connections: set[_Connection] = set()
        self._date = (0, b"")

    def __call__(self) -> _Connection:
        return _Connection(self)

    def close(self) -> None:
        """Close every connection still in the lane (those handed to aiohttp are aiohttp's to close)."""
        for connection in list(self.connections):
            connection.close()

    def body_length(self, head: bytes) -> int | None:
        """The Content-Length of a request head this lane serves; None for any other head (every head without
        httptools)."""
        if httptools is None:
            return None
        parsed = _Head()
        parser = httptools.HttpRequestParser(parsed)
        try:
            parser.feed_data(head)
        except httptools.HttpParserError:
            return None
        if (not parsed.complete or parsed.url != self.path or parser.get_method() != b"POST"
                or parser.get_http_version() != "1.1" or not parser.should_keep_alive() or parser.should_upgrade()):
            return None
        headers = parsed.headers
        if b"transfer-encoding" in headers or b"expect" in headers or b"upgrade" in headers:
            return None
        length = headers.get(b"content-length")
        if length is None or not length.isdigit() or int(length) > self.max_body:
            return None
        content_type = headers.get(b"content-type", b"")
        if content_type is None or (b"charset" in content_type.lower() and not _utf8(content_type)):
            return None
        if self.token is not None:
            authorization = headers.get(b"authorization")
            if authorization is None or not bearer_ok(authorization.decode("latin-1"), self.token):
                return None
        return int(length)

    def response(self, reply: Reply) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return b"".join((
            _status_line(reply.status),
            b"Content-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n" % len(reply.body),
            b"Date: %s\r\nServer: %s\r\n\r\n" % (self._date[1], SERVER_SOFTWARE.encode()),
            reply.body,
        ))


@functools.cache
def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())


def _utf8(content_type: bytes) -> bool:
    for param in content_type.lower().split(b";")[1:]:
        name, _, value = param.partition(b"=")
        if name.strip() == b"charset" and value.strip().strip(b'"') not in _CHARSETS:
            return False
    return True


class _Connection(asyncio.Protocol):
    """One client connection while it is the lane's."""

    def __init__(self, lane: FastLane):
        self.lane = lane
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()  # from the first byte of the request being answered (or awaited) on
        self.task: asyncio.Task | None = None
        self.head: tuple[int, int] | None = None  # the buffered request's head size and body length, once parsed
        self.idle: asyncio.TimerHandle | None = None  # one timer a connection, re-armed as it fires (not a request)
        self.last_active = 0.0  # loop time of the last bytes received or answer written
        self.loop = asyncio.get_running_loop()
        self.writing_paused = False
        self.reading_paused = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.lane.connections.add(self)
        self._wait_idle()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.last_active = self.loop.time()
        if self.task is None:
            self._next()
        elif not self.reading_paused and len(self.buffer) > self.lane.max_body + MAX_HEAD_BYTES:
            self.reading_paused = True  # a client sending ahead of its answers waits for them
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lane.connections.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client went away: its request is cancelled, which cancels the worker's
        if self.idle is not None:
            self.idle.cancel()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.task is None and self.transport is not None:
            self._next()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wait_idle(self) -> None:
        self.last_active = self.loop.time()
        self.idle = self.loop.call_at(self.last_active + IDLE_TIMEOUT_S, self._idle_check)

    def _idle_check(self) -> None:
        """Close the connection if it has received nothing and been answered nothing for IDLE_TIMEOUT_S and no
        request is being answered; else look again when that could first be so."""
        now = self.loop.time()
        if self.task is None and now >= self.last_active + IDLE_TIMEOUT_S:
            self.idle = None
            self.close()
        else:
            self.idle = self.loop.call_at(max(self.last_active, now) + IDLE_TIMEOUT_S, self._idle_check)

    def _next(self) -> None:
        """Answer the buffered request if it is whole, hand it to aiohttp if it is not the lane's."""
        if self.writing_paused or self.transport is None or self.transport.is_closing():
            return
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        buffer = self.buffer
        if self.head is None:
            end = buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 1)
            if end < 0 or end + 4 > MAX_HEAD_BYTES:
                if end >= 0 or len(buffer) > MAX_HEAD_BYTES:
                    self._hand_over()
                return
            length = self.lane.body_length(bytes(buffer[:end + 4]))
            if length is None:
                self._hand_over()
                return
            self.head = (end + 4, length)
        start, length = self.head
        if len(buffer) < start + length:
            return  # the body is still coming
        body = bytes(buffer[start:start + length])
        self.head = None
        self.task = self.loop.create_task(self._answer(body, start + length))

    async def _answer(self, body: bytes, size: int) -> None:
        try:
            reply = await self.lane.answer(body)
        except Exception:  # the front end's own failure: 500, as aiohttp answers a handler's exception
            log.exception("error answering a request")
            self.transport.write(self.lane.response(Reply(500, b'{"error": {"message": "internal error"}}')))
            self.transport.close()
            return
        finally:
            self.task = None
        if reply is None:  # not the lane's after all (a stream): aiohttp answers it, and the rest of the connection
            self._hand_over()
            return
        del self.buffer[:size]
        self.transport.write(self.lane.response(reply))
        if self.buffer:
            self._next()
        self.last_active = self.loop.time()

    def _hand_over(self) -> None:
        """The connection becomes aiohttp's, with what it has sent from the request at hand on."""
        transport, data = self.transport, bytes(self.buffer)
        self.lane.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        self.transport, self.buffer = None, bytearray()
        if self.reading_paused:
            transport.resume_reading()
        protocol = self.lane.fallback()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data:
            protocol.data_received(data)
        if self.writing_paused:
            protocol.pause_writing()
