"""A fixed trace of arrivals (images of several sizes, text alone, arrivals mid-flight) under tight scheduler limits,
and a run of it that records every step's chunks and every encode: what the real and the simulated engine are
compared on."""

from __future__ import annotations

from contract.tokenizer import IM_END_ID, IM_START_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from contract.types import FinishReason, PromptInput, SamplingParams
from contract.vision_geometry import image_geometry
from tests.helpers.image_fixtures import png
from tests.helpers.scheduler_spies import record_encodes

MIN_PIXELS, MAX_PIXELS = 4096, 65536
LIMITS = dict(num_kv_blocks=48, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=24,
              max_num_encoder_tokens=24, encoder_cache_tokens=32, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
MAX_TOKENS = 4


def prompt(images: list[bytes], text: int) -> PromptInput:
    ids = [IM_START_ID, 872, 198]
    for data in images:
        ids += [VISION_START_ID] + [IMAGE_PAD_ID] * image_geometry(data, MIN_PIXELS, MAX_PIXELS).num_tokens
        ids += [VISION_END_ID]
    return PromptInput(ids + list(range(1000, 1000 + text)) + [IM_END_ID, 198], images)


# (arrival step, request id, prompt): images of 4, 12 and 20 rows (the last beyond the encoder budget), a prompt
# with two images, text alone, and arrivals while others prefill and decode.
ARRIVALS = [
    (0, "small", prompt([png(64, 64, seed=1)], 6)),
    (0, "two", prompt([png(128, 96, seed=2), png(64, 64, seed=3)], 3)),
    (0, "big", prompt([png(160, 128, seed=4)], 2)),
    (1, "text", prompt([], 9)),
    (2, "late", prompt([png(128, 96, seed=5)], 5)),
    (3, "later", prompt([png(64, 64, seed=6)], 30)),
]


def run(engine) -> tuple[list, list]:
    """Every step's chunks (request, start, tokens) and every encode (step, request, now/ahead)."""
    encodes = record_encodes(engine)
    steps, finished = [], {}
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = spy
    step = 0
    while engine.has_unfinished() or any(s >= step for s, _, _ in ARRIVALS):
        for s, rid, p in ARRIVALS:
            if s == step:
                engine.add_request(rid, p, SamplingParams(max_tokens=MAX_TOKENS))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        step += 1
    assert finished == {rid: FinishReason.LENGTH for _, rid, _ in ARRIVALS}
    return steps, encodes
