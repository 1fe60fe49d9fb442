"""SIGINT and SIGTERM during a run: `interruptible()` turns them into `Interrupted`, raised in the main thread so
that every context manager unwinds and stops what it started; `deferred()` holds them over a step that must not
be left half done (Ray's start-up, starting a child process, a teardown, renaming a result into place) and
delivers them when the step is over.

`Interrupted` is a KeyboardInterrupt, so a BaseException: the `except Exception` that libraries wrap around their
own work (Ray's start-up logs and goes on) cannot swallow it. Ray's C++ waits (`ray.get`) check for signals
themselves and turn an interrupt into a plain KeyboardInterrupt; `signal_name()` still says which signal it was.
Raising inside code that a C extension is running (Ray's core worker being built, the interpreter inside a Cython
callback) is what crashed runs (SystemError, segfaults): such steps go in `deferred()` blocks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM arrived: everything started is torn down before exiting (exit 130). str() is the signal."""


_last_signal: str | None = None


def _raise_interrupted(signum, _frame) -> None:
    global _last_signal
    _last_signal = signal.Signals(signum).name
    raise Interrupted(_last_signal)


def signal_name(exc: KeyboardInterrupt) -> str:
    """The signal behind an interrupt: Interrupted's own, else the last one `interruptible()` saw (a library
    re-raised it as a plain KeyboardInterrupt), else SIGINT (Python's default handler raised it)."""
    if isinstance(exc, Interrupted) and exc.args:
        return str(exc.args[0])
    return _last_signal or signal.SIGINT.name


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM raise Interrupted, so every context manager unwinds (stops what it
    started). The handlers in place before are put back at the end."""
    global _last_signal
    _last_signal = None
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred(notice: str | None = None) -> Iterator[list[signal.Signals]]:
    """Inside the block SIGINT and SIGTERM are only recorded, in the list it yields (the block may look: a step
    that was interrupted can undo itself before the signal is delivered). When the block ends, the handlers in
    place before it are put back (whatever the block installed meanwhile, as ray.init does for SIGTERM) and the
    first signal recorded is delivered to them: under `interruptible()`, Interrupted is raised as the block is
    left (replacing an exception already leaving it). `notice`, if given, is printed once when a signal is held
    (what the run waits for). A signal ignored before the block stays ignored. Outside the main thread (where
    Python runs no signal handler) it does nothing."""
    held: list[signal.Signals] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum, _frame) -> None:
        if not held and notice:
            os.write(2, f"[q3vl] {signal.Signals(signum).name} received; stopping once {notice}\n".encode())
        held.append(signal.Signals(signum))

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, hold)
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])  # the handler put back runs now, before the next statement
