"""A gRPC stand-in worker that answers every request with the same reply, as the HTTP stand-ins beside vllm-router in
scripts/bench_router.py answer every chat request with the same JSON: no engine and no request parsing, so what the
benchmark measures is the router between load and workers, not the workers' own serving path.

It registers and heartbeats like a WorkerServer (workers/serve/registration.py). Generate streams one chunk and
GenerateWhole returns it: `output_tokens` fixed token ids, finish_reason LENGTH; GenerateMultiplexed answers each
request on its stream with it, reading nothing of a request but its call id. It is for measuring only: it ignores
what it is asked (max_tokens, stop ids, aborts), so it serves none of the router's correctness.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from contract.network import KeepaliveConfig
from contract.multiplexed_wire import chunk_entry, started_calls
from contract.transport import add_listener, server_options
from contract.wire import pb
from router.registry import GENERATE_METHOD, GENERATE_WHOLE_METHOD, MULTIPLEXED_METHOD
from workers.serve.registration import report_to_router

_SERVICE, _, _ = GENERATE_METHOD[1:].partition("/")
TOKEN_ID = 1_000  # every token of the reply (an ordinary id of Qwen's vocabulary)
KV_BLOCKS = 65_536


def constant_reply(output_tokens: int, prompt_tokens: int = 0) -> bytes:
    """The serialized final chunk every request gets."""
    return pb.GenerateChunk(token_ids=[TOKEN_ID] * output_tokens, finish_reason=pb.LENGTH,
                            prompt_tokens=prompt_tokens, completion_tokens=output_tokens).SerializeToString()


class ConstantWorker:
    """One stand-in worker on a loopback port, registered with `router_address` (comma-separated: several)."""

    def __init__(self, worker_id: str, router_address: str, output_tokens: int, heartbeat_interval_s: float = 1.0):
        self.worker_id = worker_id
        self.router_address = router_address
        self.reply = constant_reply(output_tokens)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._reporters: list = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _whole(self, request: bytes, context) -> bytes:
        return self.reply

    async def _stream(self, request: bytes, context):
        yield self.reply

    async def _multiplexed(self, messages, context) -> None:
        async for message in messages:  # a cancel is left out: its request was answered as it came
            if started := started_calls(message):
                await context.write(b"".join(chunk_entry(call_id, self.reply) for call_id in started))

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(worker_id=self.worker_id, address=self.address, role=pb.AGGREGATED,
                             total_kv_blocks=KV_BLOCKS)

    def load_report(self) -> pb.LoadReport:
        return pb.LoadReport(worker_id=self.worker_id, free_kv_blocks=KV_BLOCKS, total_kv_blocks=KV_BLOCKS)

    async def start(self) -> None:
        handlers = {  # bytes in, bytes out: nothing parsed, nothing built per request
            GENERATE_WHOLE_METHOD.rpartition("/")[2]: grpc.unary_unary_rpc_method_handler(self._whole),
            GENERATE_METHOD.rpartition("/")[2]: grpc.unary_stream_rpc_method_handler(self._stream),
            MULTIPLEXED_METHOD.rpartition("/")[2]: grpc.stream_stream_rpc_method_handler(self._multiplexed),
        }
        self._server = grpc.aio.server(options=server_options())
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        self.port = add_listener(self._server, "127.0.0.1:0", None)
        await self._server.start()

        async def nothing() -> None:
            pass

        self._reporters = [asyncio.get_running_loop().create_task(report_to_router(
            address, self.info, self.load_report, (), self.heartbeat_interval_s, 64 << 20, nothing, KeepaliveConfig()))
            for address in self.router_address.split(",")]

    async def stop(self) -> None:
        for task in self._reporters:
            task.cancel()
        if self._server is not None:
            await self._server.stop(0)
