"""Watching an engine's scheduling decisions from a test: every SchedulerOutput it produces from now on."""

from __future__ import annotations


def record_encodes(engine) -> list[tuple[int, str, str]]:
    """(step, request id, "now", "ahead" or "blocks A-B") of every image encode the engine's scheduler lists from
    now on, in order: whole images in the step or ahead, and the blocks of passes spread over steps (the runner
    carries out exactly these; the real and the simulated engine alike)."""
    encodes = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        step = engine.load().steps
        encodes.extend((step, e.seq.request_id, f"blocks {e.first_block}-{e.first_block + e.num_blocks - 1}"
                        if e.num_blocks else "now") for e in out.encode_now)
        encodes.extend((step, e.seq.request_id, "ahead") for e in out.encode_ahead)
        return out

    engine.scheduler.schedule = spy
    return encodes
