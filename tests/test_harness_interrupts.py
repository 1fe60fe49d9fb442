"""SIGINT and SIGTERM in the harness: an interrupt that no `except Exception` can swallow, steps that hold the
signal until they are done (and then deliver it), and Ray's start-up as one such step."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from harness.interrupts import Interrupted, deferred, interruptible, signal_name
from harness.ray_network import temp_dirs_of
from harness.ray_workers import init_ray
from harness.system_config import RaySection
from lab.soak.process_tree import ProcessWatch, descendants


def library_step_that_catches_every_exception(work) -> str:
    """How Ray's start-up wraps its steps (services.py logs the exception and goes on)."""
    try:
        work()
    except Exception as exc:  # noqa: BLE001
        return f"logged {exc}"
    return "done"


def test_an_interrupt_passes_through_a_library_that_catches_every_exception():
    with interruptible(), pytest.raises(KeyboardInterrupt) as caught:
        library_step_that_catches_every_exception(lambda: signal.raise_signal(signal.SIGINT))
    assert isinstance(caught.value, Interrupted) and signal_name(caught.value) == "SIGINT"


def test_a_library_that_turns_the_interrupt_into_a_plain_keyboard_interrupt_still_names_the_signal():
    def ray_get():  # Ray's C++ waits check for signals and raise a KeyboardInterrupt of their own
        try:
            signal.raise_signal(signal.SIGTERM)
        except KeyboardInterrupt:
            raise KeyboardInterrupt from None

    with interruptible(), pytest.raises(KeyboardInterrupt) as caught:
        ray_get()
    assert not isinstance(caught.value, Interrupted) and signal_name(caught.value) == "SIGTERM"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_deferred_step_is_delivered_once_the_step_is_done(sig):
    steps = []
    with interruptible(), pytest.raises(Interrupted, match=sig.name):
        with deferred() as held:
            signal.raise_signal(sig)
            steps.append("finished after the signal")
            assert held == [sig]
        steps.append("after the block")  # never: the signal is delivered as the block ends
    assert steps == ["finished after the signal"]


def test_a_deferred_step_that_replaced_a_handler_leaves_the_callers_in_place():
    with interruptible():
        with deferred():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init does for SIGTERM
        with pytest.raises(Interrupted, match="SIGTERM"):
            signal.raise_signal(signal.SIGTERM)


def test_nested_deferred_steps_deliver_the_signal_when_the_outermost_ends():
    steps = []
    with interruptible(), pytest.raises(Interrupted):
        with deferred():
            with deferred():
                signal.raise_signal(signal.SIGINT)
            steps.append("outer step goes on")
    assert steps == ["outer step goes on"]


def test_a_deferred_step_outside_interruptible_delivers_to_pythons_own_handler():
    # Python's own handler in place, whatever an earlier test in this worker process left there (CI once found
    # SIGINT ignored here, which deferred() rightly keeps ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred():
                signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_while_ray_starts_is_delivered_once_ray_is_up_and_shut_down_again(monkeypatch):
    assert not ray.is_initialized()
    # the test process's own helpers from earlier tests (multiprocessing's resource tracker) live until it exits
    before = set(descendants(os.getpid()))
    watch = ProcessWatch(os.getpid())
    start_api_server = ray._private.node.Node.start_api_server

    def signal_once_the_api_server_started(node, *args, **kwargs):  # where ray.init used to catch one and go on
        start_api_server(node, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # mid-start, from ray.init's own thread: never after it returned

    monkeypatch.setattr(ray._private.node.Node, "start_api_server", signal_once_the_api_server_started)
    with interruptible(), pytest.raises(Interrupted, match="SIGTERM"):
        init_ray(RaySection(num_cpus=1, num_gpus=0), address=None)
    assert watch.wait_for("ray/dashboard/dashboard.py", timeout_s=0)  # its API server had started by the signal
    assert not ray.is_initialized()
    assert temp_dirs_of(os.getpid()) == []
    assert {pid: cmd for pid, cmd in watch.left_running().items() if pid not in before} == {}
