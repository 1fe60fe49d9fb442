"""A stand-in for grpc.aio's ServicerContext in tests that drive a servicer's handler directly (no channel), for
interleavings a real call cannot be made to hit on purpose."""

from __future__ import annotations


class CallContext:
    """What our handlers use of a ServicerContext; end() runs the done callbacks, as gRPC does when a call ends."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def time_remaining(self) -> None:
        return None

    async def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)
