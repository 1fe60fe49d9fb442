"""The OpenAI-compatible HTTP front end (aiohttp): /v1/chat/completions (SSE or not), /v1/models,
/health and /metrics, serving through the same Dispatcher as the gRPC RouterService.

Images come only as data: URLs (remote URLs get 400 and are never fetched); a flood beyond admission gets 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from router.config import RouterConfig, split_host_port
from router.detokenize import IncrementalDetokenizer
from router.dispatch import Dispatcher, RouterError
from router.registry import SERVING_ROLES, Registry
from router.transport import bearer_ok
from router.wire import pb
from workers.chat import encode_chat
from workers.tokenizer import QwenTokenizer, load_tokenizer

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
}
_FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}


class BadRequest(ValueError):
    """The request body is not a chat completion request this endpoint serves."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def sampling_from_body(body: dict[str, Any], default_max_tokens: int) -> pb.SamplingParams:
    """OpenAI fields -> SamplingParams; with no sampling field at all the model's defaults apply (MLPerf)."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    sampling = pb.SamplingParams(max_tokens=max_tokens)
    if body.get("seed") is not None:
        sampling.has_seed, sampling.seed = True, int(body["seed"])
    given = {k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None}
    if not given:
        sampling.use_model_defaults = True
        return sampling
    try:
        sampling.temperature = float(given.get("temperature", 1.0))
        sampling.top_p = float(given.get("top_p", 1.0))
        sampling.top_k = max(int(given.get("top_k", 0)), 0)  # vLLM's -1 means disabled, like our 0
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"bad sampling parameter: {exc}") from None
    return sampling


class HttpFrontend:
    def __init__(self, config: RouterConfig, dispatcher: Dispatcher, registry: Registry):
        self.config = config
        self.dispatcher = dispatcher
        self.registry = registry
        self.tokenizer: QwenTokenizer | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Load the tokenizer, bind http_listen; returns the bound port."""
        self.tokenizer = await asyncio.to_thread(load_tokenizer)
        app = web.Application(middlewares=[self._auth], client_max_size=self.config.limits.max_message_bytes)
        app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        # handler_cancellation: a client that disconnects cancels its handler, which aborts upstream.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        host, port = split_host_port(self.config.http_listen)
        ssl_context = None
        if self.config.tls is not None:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls.cert, self.config.tls.key)
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.config.token
        if token and request.path != "/health" and not bearer_ok(request.headers.get("Authorization"), token):
            return _error(401, "missing or wrong bearer token", "authentication_error")
        return await handler(request)

    # -- endpoints ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.served_model_name, "object": "model", "created": 0, "owned_by": "q3vl"}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        entries = self.registry.entries()
        serving = any(e.healthy and e.role in SERVING_ROLES for e in entries)
        workers = [{"worker_id": e.worker_id, "address": e.address, "role": pb.WorkerRole.Name(e.role),
                    "healthy": e.healthy, "inflight": e.inflight} for e in entries]
        return web.json_response({"status": "healthy" if serving else "unhealthy", "workers": workers},
                                 status=200 if serving else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.dispatcher.metrics.render(), content_type="text/plain", charset="utf-8")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            sampling = sampling_from_body(body, self.config.default_max_tokens)
            prompt = encode_chat(messages, self.tokenizer)  # ValueError names the bad message / image
        except (json.JSONDecodeError, ValueError) as exc:
            return _error(400, str(exc))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen_request = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt.token_ids, images=prompt.images, sampling=sampling
        )
        chunks = self.dispatcher.generate(gen_request)
        try:
            first = await anext(chunks)  # refusals (429, 503, ...) surface here, before any byte is sent
        except RouterError as exc:
            await chunks.aclose()
            return _error(_HTTP_STATUS.get(exc.code, 500), exc.message, "router_error")
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, request_id, first, chunks, include_usage)
            return await self._complete(request_id, first, chunks)
        finally:
            await chunks.aclose()

    # -- responses ------------------------------------------------------------------------------

    def _envelope(self, request_id: str, obj: str) -> dict[str, Any]:
        return {"id": request_id, "object": obj, "created": int(time.time()), "model": self.config.served_model_name}

    async def _complete(self, request_id: str, first: pb.GenerateChunk, rest: AsyncIterator[pb.GenerateChunk]):
        tokens = list(first.token_ids)
        last = first
        try:
            async for chunk in rest:
                tokens.extend(chunk.token_ids)
                last = chunk
        except RouterError as exc:
            return _error(_HTTP_STATUS.get(exc.code, 500), exc.message, "router_error")
        if last.finish_reason == pb.ERROR:
            return _error(502, last.error or "the request failed upstream", "upstream_error")
        out = self._envelope(request_id, "chat.completion")
        out["choices"] = [{
            "index": 0,
            "message": {"role": "assistant", "content": self.tokenizer.decode(tokens)},
            "finish_reason": _FINISH.get(last.finish_reason, "stop"),
        }]
        out["usage"] = _usage(last)
        return web.json_response(out)

    async def _stream(
        self, request: web.Request, request_id: str, first: pb.GenerateChunk,
        rest: AsyncIterator[pb.GenerateChunk], include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        detok = IncrementalDetokenizer(self.tokenizer)
        base = self._envelope(request_id, "chat.completion.chunk")

        async def send(delta: dict, finish: str | None = None, usage: dict | None = None, choices=True) -> None:
            event = dict(base)
            event["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []
            if usage is not None:
                event["usage"] = usage
            await response.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        chunk = first
        try:
            while True:
                text = detok.add(chunk.token_ids)
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    text += detok.finish()
                    if text:
                        await send({"content": text})
                    if chunk.finish_reason == pb.ERROR:
                        await send({}, "error")
                        log.warning("request %s failed upstream: %s", request_id, chunk.error)
                    else:
                        await send({}, _FINISH.get(chunk.finish_reason, "stop"))
                    if include_usage:
                        await send({}, usage=_usage(chunk), choices=False)
                    break
                if text:
                    await send({"content": text})
                chunk = await anext(rest)
        except RouterError as exc:  # mid-stream: the status line is gone, say it in the stream
            await response.write(f"data: {json.dumps({'error': {'message': exc.message}})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _usage(chunk: pb.GenerateChunk) -> dict[str, int]:
    return {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
    }
