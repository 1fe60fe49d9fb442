"""The asyncio event loop our processes run on: uvloop's (libuv, https://github.com/MagicStack/uvloop) where it is
installed, else asyncio's own.

uvloop is a dependency (pyproject.toml); the fallback keeps a platform without its wheel working. The router, the
worker servers, the Ray worker actors and the harness SUT all take their loop from here, so every process on the
request path runs the same loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships wheels for the platforms we run on
    uvloop = None


def loop_name() -> str:
    """'uvloop' or 'asyncio': which loop run() and new_event_loop() give."""
    return "asyncio" if uvloop is None else "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop this module picks."""
    if uvloop is None:
        return asyncio.run(main)
    return uvloop.run(main)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the kind run() uses, for a thread that drives its own (the SUT, a Ray actor)."""
    return asyncio.new_event_loop() if uvloop is None else uvloop.new_event_loop()
