"""gRPC plumbing shared by the router, its client and the workers: channels, listeners, token auth, refusal of
unparseable requests, clean-up of a streaming call that ends before its last message.

Every call carries `authorization: Bearer <token>` when a token is set; servers reject calls without it.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from contract.network import MIB, KeepaliveConfig, TlsConfig

HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"

_CLEAN_UPS: set[asyncio.Task] = set()  # held until done: the event loop keeps only weak references to tasks


def when_call_ends_unfinished(context: grpc.aio.ServicerContext, finished: Callable[[], bool],
                              clean_up: Callable[[], Awaitable[None]]) -> None:
    """Runs clean_up() on this event loop once the call ends, unless finished() says its handler got to the end.

    A server-streaming handler cannot rely on its own `except asyncio.CancelledError`: gRPC cancels a call it is
    writing a message of in its own code, and the handler's generator then stays suspended at its yield, its
    except and finally blocks unrun until the generator is collected. The call's end is reported all the same."""
    loop = asyncio.get_running_loop()

    def start() -> None:
        task = loop.create_task(clean_up())
        _CLEAN_UPS.add(task)
        task.add_done_callback(_CLEAN_UPS.discard)

    def call_ended(_context) -> None:
        if not finished():
            loop.call_soon_threadsafe(start)

    context.add_done_callback(call_ended)


def channel_options(max_message_bytes: int = 64 * MIB, keepalive: KeepaliveConfig = KeepaliveConfig(),
                    reconnect_backoff_s: float | None = None, retries: bool = True) -> list[tuple[str, int]]:
    """Large messages (images travel inline), keepalive so a dead peer is noticed, on idle connections too.

    reconnect_backoff_s caps the wait between attempts to reach a peer that is not listening. gRPC's own backoff
    grows by 1.6x from 1 s to 120 s, so a channel whose peer was away for minutes finds it back up to two minutes
    after it returns (20 s away: 7.6 s later, measured).

    retries=False takes gRPC's retry filter off the channel's calls (`grpc.enable_retries` 0): a caller that replays
    failed calls itself (the router's migration, contract.resend) gains nothing from it, and it buffers each call's
    messages for a replay that never comes."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", round(keepalive.time_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(keepalive.timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if reconnect_backoff_s is not None:
        cap_ms = max(1, round(reconnect_backoff_s * 1000))
        options += [("grpc.initial_reconnect_backoff_ms", min(1000, cap_ms)), ("grpc.max_reconnect_backoff_ms", cap_ms)]
    if not retries:
        options.append(("grpc.enable_retries", 0))
    return options


def server_options(max_message_bytes: int = 64 * MIB) -> list[tuple[str, int]]:
    """Our servers accept their clients' pings at any rate. gRPC's default policy answers a third ping that comes
    sooner than min_recv_ping_interval_without_data after the last one, with no data sent between, by GOAWAY
    ENHANCE_YOUR_CALM "too_many_pings", which closes the connection and fails its streams (the router then marks the
    worker down and migrates). A server interval fixed apart from the clients' keepalive is such a mismatch; with
    max_ping_strikes 0 no ping costs a connection. Our listeners are loopback or token-guarded, so the flood this
    policy guards against would come from our own processes."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def open_channel(
    address: str, *, max_message_bytes: int = 64 * MIB, root_certificates: bytes | None = None,
    keepalive: KeepaliveConfig = KeepaliveConfig(), reconnect_backoff_s: float | None = None, retries: bool = True,
) -> grpc.aio.Channel:
    options = channel_options(max_message_bytes, keepalive, reconnect_backoff_s, retries)
    if root_certificates is not None:
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def add_listener(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    """Bind `address` (TLS when configured); returns the bound port."""
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials([(tls.key.read_bytes(), tls.cert.read_bytes())])
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind gRPC listener on {address}")
    return port


def bearer_ok(header: str | None, token: str) -> bool:
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the shared token (UNAUTHENTICATED). Health checks stay open: they carry no
    secret and reveal only SERVING / NOT_SERVING, and probes (Kubernetes) cannot send a token."""

    def __init__(self, token: str):
        self._token = token

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_SERVICE_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_ok(metadata.get("authorization"), self._token):
            return handler
        return _unauthenticated_like(handler)


def _unauthenticated_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong bearer token"
    if handler.request_streaming:  # a bidirectional stream (WorkerService.GenerateMultiplexed)

        async def reject_bidi(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.stream_stream_rpc_method_handler(
            reject_bidi, handler.request_deserializer, handler.response_serializer
        )
    if handler.response_streaming:

        async def reject_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover  (makes this an async generator, matching the method's type)

        return grpc.unary_stream_rpc_method_handler(
            reject_stream, handler.request_deserializer, handler.response_serializer
        )

    async def reject_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(reject_unary, handler.request_deserializer, handler.response_serializer)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    """What every server of ours runs: with a token, calls without it get UNAUTHENTICATED (checked first, so an
    unauthenticated caller learns nothing more); then request bytes that do not parse get INVALID_ARGUMENT."""
    return ([TokenAuthInterceptor(token)] if token else []) + [MalformedRequestInterceptor()]


class _Malformed:
    def __init__(self, error: str):
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request whose bytes are not the method's message is answered INVALID_ARGUMENT naming the method (grpc
    itself answers UNKNOWN), before the servicer sees it. gRPC asks an interceptor for every call; each method's
    handler is looked up and wrapped at its first call, and kept (a server's methods are fixed once it serves)."""

    def __init__(self):
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        wrapped = self._handlers.get(method)
        if wrapped is None:
            wrapped = _refusing_malformed(await continuation(handler_call_details), method)
            if wrapped is not None:  # an unknown method is looked up again next time
                self._handlers[method] = wrapped
        return wrapped


def _refusing_malformed(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """`handler`, answering a request whose bytes do not parse INVALID_ARGUMENT (MalformedRequestInterceptor)."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    def tolerant_parse(data: bytes):
        try:
            return parse(data)
        except DecodeError as exc:
            return _Malformed(str(exc))

    async def refuse(request: _Malformed, context) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: request is not a valid message: {request.error}")

    if handler.response_streaming:

        async def stream(request, context):
            if isinstance(request, _Malformed):
                await refuse(request, context)
            async for response in handler.unary_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, tolerant_parse, handler.response_serializer)

    async def unary(request, context):
        if isinstance(request, _Malformed):
            await refuse(request, context)
        return await handler.unary_unary(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, tolerant_parse, handler.response_serializer)
