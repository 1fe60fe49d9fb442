"""The OpenAI-compatible HTTP front end (aiohttp): /v1/chat/completions (SSE or not), /v1/models[/{id}],
/health and /metrics, serving through the same Dispatcher as the gRPC RouterService. Chat completions sent whole on
kept-alive connections, the hot path, go through router/http_fast_lane.py instead of aiohttp, with the same answers
(HttpFrontend.answer_whole writes them for both); JSON in and out through router/json_codec.py.

Images come only as data: URLs (remote URLs get 400 and are never fetched); a flood beyond admission gets 429;
a prompt longer than the workers' context or KV pool gets 400 naming the limit; a model other than the served one
gets 404 model_not_found; fields: router/openai_params.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
from aiohttp import web

from contract.chat import MessageError, encode_chat
from contract.network import split_host_port
from contract.transport import bearer_ok
from contract.types import PromptInput
from contract.wire import pb
from router import json_codec
from router.completion_text import CompletionText
from router.config import RouterConfig
from router.dispatch import Dispatcher, RouterError
from router.http_fast_lane import FastLane, Reply
from router.openai_params import BadRequest, ChatRequest, parse_chat_request
from router.prompt_encoder import PromptEncoder
from router.registry import SERVING_ROLES, Registry

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
}
CHAT_PATH = "/v1/chat/completions"
_FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}


class Answer(NamedTuple):
    """A reply sent whole: its HTTP status and JSON body (what either transport writes)."""

    status: int
    body: dict[str, Any]


def _error_answer(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                  code: int | str | None = None) -> Answer:
    """OpenAI's error body; code is the HTTP status, as vLLM writes it, unless a code is named."""
    error = {"message": message, "type": kind, "param": param, "code": status if code is None else code}
    return Answer(status, {"error": error})


def json_response(answer: Answer) -> web.Response:
    return web.Response(body=json_codec.dumps(answer.body), status=answer.status, content_type="application/json",
                        charset="utf-8")


def _model_not_found(model: str) -> Answer:
    """404 for a model this router does not serve: vLLM's message, type and param (OpenAIServing._check_model in
    https://github.com/vllm-project/vllm/blob/main/vllm/entrypoints/openai/engine/serving.py), with OpenAI's
    error code model_not_found where vLLM repeats the status."""
    return _error_answer(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")


def _final_chunk_only(chat: ChatRequest) -> bool:
    """GenerateRequest.final_chunk_only for a chat request: a reply sent whole needs the tokens only at the end, so
    the worker sends them all in its final chunk (one message per hop instead of one per engine step); a stream (its
    client times each delta) or stop strings (matched as text arrives, to cancel the worker's request at the match)
    take every step's tokens."""
    return not (chat.stream or chat.stop)


class HttpFrontend:
    def __init__(self, config: RouterConfig, dispatcher: Dispatcher, registry: Registry):
        self.config = config
        self.dispatcher = dispatcher
        self.registry = registry
        self.tokenizer: PromptEncoder | None = None
        self._runner: web.AppRunner | None = None
        self._lane: FastLane | None = None
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        """Load the tokenizer (tiktoken's encoder of the prompts, `tokenizers`' decoder of the replies), bind
        http_listen; returns the bound port."""
        self.tokenizer = await asyncio.to_thread(PromptEncoder)
        # No token, no middleware: every request would pass it, at the cost of one more coroutine hop each.
        middlewares = [self._auth] if self.config.token else []
        app = web.Application(middlewares=middlewares, client_max_size=self.config.limits.max_message_bytes)
        app.add_routes([
            web.post(CHAT_PATH, self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),  # ids hold a "/" (Qwen/Qwen3-VL-...)
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
        # One listener: chat completions sent whole through the fast lane, every other request through aiohttp.
        self._lane = FastLane(CHAT_PATH.encode(), self.fast_chat, self._runner.server,
                              self.config.limits.max_message_bytes, self.config.token)
        self._server = await asyncio.get_running_loop().create_server(self._lane, host, port, ssl=ssl_context,
                                                                      reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._lane.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()

    async def fast_chat(self, body: bytes) -> Reply | None:
        """The fast lane's answer to a chat request's body: the whole reply, or None for a stream (aiohttp's)."""
        chat = self.parse_chat(body)
        if isinstance(chat, Answer):
            return Reply(chat.status, json_codec.dumps(chat.body))
        if chat.stream:
            return None
        answer = await self.answer_whole(chat)
        return Reply(answer.status, json_codec.dumps(answer.body))

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.config.token
        if token and request.path != "/health" and not bearer_ok(request.headers.get("Authorization"), token):
            return json_response(_error_answer(401, "missing or wrong bearer token", "authentication_error"))
        return await handler(request)

    # -- endpoints ------------------------------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.served_model_name, "object": "model", "created": 0, "owned_by": "q3vl"}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.config.served_model_name:
            return json_response(_model_not_found(model_id))
        return web.json_response(self._model_card())

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
        body = await request.read()
        if request.charset not in (None, "utf-8", "utf8"):  # a body in another charset, as UTF-8
            body = (await request.text()).encode("utf-8")
        chat = self.parse_chat(body)
        if isinstance(chat, Answer):
            return json_response(chat)
        if not chat.stream:
            return json_response(await self.answer_whole(chat))
        opened = self._open(chat)
        if isinstance(opened, Answer):
            return json_response(opened)
        request_id, prompt = opened
        reply = await self._first(chat, request_id, prompt)
        if isinstance(reply, Answer):
            return json_response(reply)
        try:
            return await self._stream(request, request_id, reply, chat)
        finally:
            await self._close(reply)

    def parse_chat(self, body: bytes) -> ChatRequest | Answer:
        """A request body as a chat request for the served model, or the 400 / 404 that answers it."""
        try:
            chat = parse_chat_request(json_codec.loads(body), self.config.default_max_tokens)
        except (BadRequest, MessageError) as exc:
            return _error_answer(400, str(exc), param=exc.param)
        except ValueError as exc:  # not JSON (json.JSONDecodeError), not UTF-8
            return _error_answer(400, str(exc))
        if chat.model not in (None, self.config.served_model_name):  # never answered by another model
            return _model_not_found(chat.model)
        return chat

    async def answer_whole(self, chat: ChatRequest) -> Answer:
        """The whole reply to a chat request that is not streamed: a chat.completion, or the error that answers it."""
        opened = self._open(chat)
        if isinstance(opened, Answer):
            return opened
        request_id, prompt = opened
        reply = await self._first(chat, request_id, prompt)
        if isinstance(reply, Answer):
            return reply
        try:
            return await self._complete(request_id, reply)
        finally:
            await self._close(reply)

    def _open(self, chat: ChatRequest) -> tuple[str, PromptInput] | Answer:
        """The request's id and its prompt, tokenized; 400 when a message or image is bad or the prompt too long."""
        try:
            prompt = encode_chat(chat.messages, self.tokenizer)  # MessageError names the bad message / image
            self._check_fits(len(prompt.token_ids))
        except (BadRequest, MessageError) as exc:
            return _error_answer(400, str(exc), param=exc.param)
        except ValueError as exc:
            return _error_answer(400, str(exc))
        return f"chatcmpl-{os.urandom(16).hex()}", prompt  # 32 random hex digits, as uuid4().hex, no UUID built

    async def _first(self, chat: ChatRequest, request_id: str, prompt: PromptInput) -> _Reply | Answer:
        """Dispatch the request and read its first chunk: the reply to read on, or the refusal (429, 503, ...) that
        answers it, before any byte is sent."""
        gen_request = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt.token_ids, images=prompt.images, sampling=chat.sampling,
            final_chunk_only=_final_chunk_only(chat),
        )
        chunks = self.dispatcher.generate(gen_request)
        try:
            first = await anext(chunks)
        except RouterError as exc:
            await chunks.aclose()
            return _error_answer(_HTTP_STATUS.get(exc.code, 500), exc.message, "router_error")
        text = CompletionText(self.tokenizer, chat.stop, chat.sampling.stop_token_ids, whole=not chat.stream)
        return _Reply(request_id, first, chunks, text, len(prompt.token_ids))

    async def _close(self, reply: _Reply) -> None:
        """However the reply was read: the dispatcher's stream ended, the request counted by how it ended."""
        chunks = reply.chunks
        if reply.stopped:
            self.dispatcher.complete_early(reply.request_id)  # counted as STOP, not as a caller gone away
        elif reply.ended:
            # Run the stream out: each generator under it then returns. Closed at its final chunk instead, it
            # leaves the generators it was iterating to the event loop's finalizer, one task each.
            await anext(chunks, None)
        await chunks.aclose()  # also how a stop string ends the request: the worker's call is cancelled

    def _check_fits(self, num_prompt_tokens: int) -> None:
        """BadRequest when the prompt is longer than some worker's max_model_len or its whole KV pool (as vLLM
        answers, rather than a failure upstream); workers that report no limits are not checked."""
        for entry in self.registry.entries():
            info = entry.info
            if not entry.healthy:
                continue
            if info.max_model_len and num_prompt_tokens > info.max_model_len:
                raise BadRequest(
                    f"This model's maximum context length (max_model_len) is {info.max_model_len} tokens. However, "
                    f"your messages resulted in {num_prompt_tokens} tokens (text and image tokens). Please reduce "
                    "the length of the messages or the size of the images.", "messages")
            pool = info.total_kv_blocks * info.kv_block_size
            if pool and num_prompt_tokens > pool:
                raise BadRequest(
                    f"Your messages resulted in {num_prompt_tokens} tokens (text and image tokens), more than the KV "
                    f"cache of worker {entry.worker_id} holds ({info.total_kv_blocks} blocks of {info.kv_block_size} "
                    f"= {pool} tokens). Please reduce the length of the messages or the size of the images.",
                    "messages")

    # -- responses ------------------------------------------------------------------------------

    def _envelope(self, request_id: str, obj: str) -> dict[str, Any]:
        return {"id": request_id, "object": obj, "created": int(time.time()), "model": self.config.served_model_name}

    async def _complete(self, request_id: str, reply: _Reply) -> Answer:
        try:
            async for _ in reply.deltas():
                pass
        except RouterError as exc:
            return _error_answer(_HTTP_STATUS.get(exc.code, 500), exc.message, "router_error")
        if reply.failed:
            return _error_answer(502, reply.last.error or "the request failed upstream", "upstream_error")
        out = self._envelope(request_id, "chat.completion")
        out["choices"] = [{
            "index": 0,
            "message": {"role": "assistant", "content": reply.text.text},
            "finish_reason": reply.finish_reason,
            "stop_reason": reply.text.stop_reason,  # vLLM's extension: the stop string or token id that ended it
        }]
        out["usage"] = reply.usage()
        return Answer(200, out)

    async def _stream(self, request: web.Request, request_id: str, reply: _Reply,
                      chat: ChatRequest) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        base = self._envelope(request_id, "chat.completion.chunk")

        async def send(delta: dict, finish: str | None = None, usage: dict | None = None, choices=True) -> None:
            event = dict(base)
            event["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []
            if finish is not None:
                event["choices"][0]["stop_reason"] = reply.text.stop_reason
            if usage is not None:
                event["usage"] = usage
            await response.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        try:
            async for delta in reply.deltas():
                await send({"content": delta})
            if reply.failed:
                await send({}, "error")
                log.warning("request %s failed upstream: %s", request_id, reply.last.error)
            else:
                await send({}, reply.finish_reason)
            if chat.include_usage:
                await send({}, usage=reply.usage(), choices=False)
        except RouterError as exc:  # mid-stream: the status line is gone, say it in the stream
            await response.write(f"data: {json.dumps({'error': {'message': exc.message}})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Reply:
    """One request's chunks read through its CompletionText: the text deltas, then how it ended."""

    def __init__(self, request_id: str, first: pb.GenerateChunk, chunks: AsyncIterator[pb.GenerateChunk],
                 text: CompletionText, num_prompt_tokens: int):
        self.request_id = request_id
        self._first, self.chunks, self.text = first, chunks, text
        self.num_prompt_tokens = num_prompt_tokens
        self.last = first
        self.stopped = False  # a stop string matched: the request was ended here

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas, never past a stop string; RouterError when the router fails mid-stream."""
        chunk = self._first
        while True:
            self.last = chunk
            finished = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            self.stopped = self.text.add(chunk.token_ids, finished)
            delta = self.text.take(final=finished or self.stopped)
            if delta:
                yield delta
            if finished or self.stopped:
                return
            chunk = await anext(self.chunks)

    @property
    def ended(self) -> bool:
        """The final chunk has been read."""
        return self.last.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    @property
    def failed(self) -> bool:
        return not self.stopped and self.last.finish_reason == pb.ERROR

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else _FINISH.get(self.last.finish_reason, "stop")

    def usage(self) -> dict[str, int]:
        completion = self.text.num_tokens if self.stopped else self.last.completion_tokens
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.num_prompt_tokens + completion}
