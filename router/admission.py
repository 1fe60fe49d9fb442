"""Admission control: a request runs when a slot is free, waits in a bounded FIFO queue otherwise.

Beyond the queue it is rejected at once (gRPC RESOURCE_EXHAUSTED, HTTP 429) instead of piling up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Rejected(Exception):
    """The admission queue is full."""


class Admission:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def admit_now(self, has_capacity: Callable[[], bool]) -> bool:
        """True when a request may run at once: nobody waits ahead of it and `has_capacity()` holds."""
        return not self._waiters and has_capacity()

    async def admit(self, has_capacity: Callable[[], bool]) -> None:
        """Return once `has_capacity()` holds, first come first served; raise Rejected if the queue is full.

        Callers bound the wait with their deadline (asyncio.timeout); a cancelled waiter leaves the queue.
        """
        if self.admit_now(has_capacity):
            return
        if len(self._waiters) >= self.max_queue:
            raise Rejected(f"admission queue full ({self.max_queue} waiting)")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            while True:
                await waiter
                if has_capacity():
                    return
                waiter = asyncio.get_running_loop().create_future()  # capacity went elsewhere: stay first
                self._waiters[0] = waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self.notify()  # pass the turn on (capacity may remain, or this waiter gave up)

    def notify(self) -> None:
        """Capacity may have freed up: wake the first waiter to re-check."""
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)
