"""Greedy tokens of the engine equal transformers' own generate() on the same tiny checkpoint.

The reference side uses only transformers (its PIL image processor, its model, its generate); the engine
side uses only the engine's code path (workers.inputs.image_processing, the paged model, the scheduler).
"""

from __future__ import annotations

import pytest
import torch

from contract.types import PromptInput
from tests.helpers.engine_equivalence import (IM_START, IMAGE_PAD, NEW_TOKENS, VISION_END, VISION_START, make_engine,
                                              run_to_completion, transformers_reference)
from tests.helpers.image_fixtures import png
from tests.helpers.scheduler_spies import record_encodes
from workers.core.slack import StepClock


@pytest.fixture(scope="module", params=["moe", "dense"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch, request):
    return request.getfixturevalue(f"tiny_{arch}_checkpoint")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers_reference(checkpoint)


def test_text_only_prompts_match_transformers(checkpoint, reference):
    cases = {"short": [9707, 11, 1246], "longer": list(range(1000, 1040))}
    expected = {rid: reference([], ids) for rid, ids in cases.items()}
    engine = make_engine(checkpoint)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in expected.items()]})
    assert got == {rid: toks for rid, (_, toks) in expected.items()}


def test_one_image_of_odd_size_matches_transformers(checkpoint, reference):
    prompt, expected = reference([png(67, 45, seed=1)], [3838, 374, 419])
    engine = make_engine(checkpoint)
    assert run_to_completion(engine, {0: [("img", prompt)]}) == {"img": expected}


def test_batch_of_requests_with_several_images_of_different_sizes_matches_transformers(checkpoint, reference):
    cases = {
        "two-images": reference([png(130, 90, seed=2), png(40, 200, seed=3)], [3838, 374]),
        "one-image": reference([png(96, 96, seed=4)], [1, 2, 3]),
        "text": reference([], [5, 6, 7, 8]),
    }
    engine = make_engine(checkpoint)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_requests_added_while_others_decode_match_transformers(checkpoint, reference):
    cases = {
        "first": reference([png(64, 64, seed=5)], [11, 12]),
        "second": reference([], [13, 14, 15]),
        "third": reference([png(100, 50, seed=6)], [16]),
    }
    engine = make_engine(checkpoint)
    arrivals = {0: [("first", cases["first"][0])], 3: [("second", cases["second"][0])], 5: [("third", cases["third"][0])]}
    got = run_to_completion(engine, arrivals)
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_images_of_the_next_steps_prompts_are_encoded_a_step_early_and_still_match_transformers(checkpoint, reference):
    cases = {
        "first": reference([png(64, 64, seed=8)], [21, 22]),
        "second": reference([png(64, 64, seed=9)], [23, 24]),
    }
    # 16-token prompts, the 4 visual tokens at rows 4-7; 20 tokens a step: step 0 is all of "first" and rows
    # 0-3 of "second"; its image rows come in step 1.
    assert [len(prompt.token_ids) for prompt, _ in cases.values()] == [16, 16]
    engine = make_engine(checkpoint, max_num_batched_tokens=20)
    encoded = record_encodes(engine)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert encoded == [(0, "first", "now"), (0, "second", "ahead")]
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_without_encode_ahead_each_image_is_encoded_in_the_step_that_needs_it(checkpoint, reference):
    cases = {
        "first": reference([png(64, 64, seed=8)], [21, 22]),
        "second": reference([png(64, 64, seed=9)], [23, 24]),
    }
    # the steps of the test above, one at a time (overlapped ones schedule a step ahead: tests/test_engine_overlap.py)
    engine = make_engine(checkpoint, max_num_batched_tokens=20, encode_ahead=False, overlap_decode_steps=False)
    encoded = record_encodes(engine)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert encoded == [(0, "first", "now"), (1, "second", "now")]
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_warm_up_runs_throw_away_requests_and_leaves_the_engine_as_new_and_matching_transformers(checkpoint, reference, arch):
    cases = {"first": reference([png(64, 64, seed=8)], [21, 22]), "text": reference([], [5, 6, 7])}
    engine = make_engine(checkpoint, warm_up_image_sizes=((1000, 1000), (64, 128), (48, 48)),
                         overlap_decode_steps=False)  # the steps of one at a time (overlapped: one more, see warm_up)
    encoded = record_encodes(engine)
    # MoE (top-2): one step per pair of untuned tile configs (pairs <= 64, <= 4,096, above) up to the 4,096 tokens
    # of 256 blocks; dense: none. On CUDA the engine runs both warm-ups itself (EngineConfig.warm_up).
    assert engine.executor.warm_up()["text_step_tokens"] == ([32, 33, 2049] if arch == "moe" else [])
    report = engine.warm_up(engine.inputs.warm_up_prompts())
    # the first request alone (prefill), the other two beside its decode (a mixed step), then decodes: its third
    # token, theirs; their two images in one tower call in the mixed step
    assert (report["requests"], report["steps"]) == (3, 4)
    assert encoded == [(0, "warm-up-0", "now"), (1, "warm-up-1", "now"), (1, "warm-up-2", "now")]
    assert not engine.has_unfinished() and engine.load().steps == 0 and engine.scheduler.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.step_clock == StepClock()  # the warm-up's steps (compiling) teach the clock nothing
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_an_image_already_in_the_kv_cache_is_not_encoded_again_when_its_prompt_continues(checkpoint, reference):
    prompt, expected = reference([png(64, 64, seed=10)], [25, 26])
    engine = make_engine(checkpoint, max_num_batched_tokens=10)  # step 0: rows 0-9, the image rows 4-7 among them
    encoded = record_encodes(engine)
    assert run_to_completion(engine, {0: [("img", prompt)]}) == {"img": expected}
    assert encoded == [(0, "img", "now")]
    assert len(engine.scheduler.encoder_cache) == 0  # freed by the step that put its last rows in the KV cache


@pytest.mark.parametrize("companion", ["text", "image", "none"])
def test_an_image_encoded_over_several_steps_a_few_tower_blocks_at_a_time_matches_transformers(checkpoint, reference,
                                                                                               companion):
    cases = {"img": reference([png(64, 64, seed=11)], [27, 28])}
    if companion == "text":
        cases["text"] = reference([], [29, 30, 31])
    if companion == "image":
        cases["img2"] = reference([png(64, 64, seed=12)], [32, 33])
    # an encoder budget below the image's cost: while another request is there its pass is spread over steps, one
    # tower block a step, and the text prompt goes on (or the second image's request waits behind it: steps that run
    # only the tower's next block); its rows wait for the last block. The only request's image runs in one go.
    engine = make_engine(checkpoint, max_num_encoder_tokens=2, overlap_decode_steps=False)  # step numbers one at a time
    depth = engine.scheduler.limits.vision.depth
    encoded = record_encodes(engine)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    if companion == "none":
        assert encoded == [(0, "img", "now")]
    else:
        assert encoded[:depth] == [(step, "img", f"blocks {step}-{step}") for step in range(depth)]
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_long_prompt_prefilled_in_chunks_matches_transformers(checkpoint, reference):
    cases = {
        "long-image": reference([png(160, 128, seed=7)], list(range(2000, 2030))),
        "long-text": reference([], list(range(3000, 3050))),
    }
    engine = make_engine(checkpoint, max_num_batched_tokens=13)
    chunked = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        chunked.extend(c.num_tokens for c in out.chunks if not c.samples)
        return out

    engine.scheduler.schedule = spy
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert chunked, "the prompts were expected to be split over several steps"
    assert got == {rid: toks for rid, (_, toks) in cases.items()}


def test_kv_cache_too_small_for_all_requests_preempts_and_still_matches_transformers(checkpoint, reference):
    cases = {f"r{i}": reference([png(64, 64, seed=10 + i)] if i % 2 else [], list(range(100 * i, 100 * i + 6)),
                                max_new_tokens=12) for i in range(3)}
    engine = make_engine(checkpoint, num_kv_blocks=10, block_size=4)
    preempted = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        preempted.extend(out.preempted)
        return out

    engine.scheduler.schedule = spy
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]}, max_tokens=12)
    assert preempted, "the KV pool was sized to force preemption"
    assert got == {rid: toks for rid, (_, toks) in cases.items()}
    assert engine.block_manager.num_free_blocks == 10


@pytest.mark.gpu
def test_a_pass_spread_beside_the_steps_in_a_green_context_gives_the_steps_own_tokens_on_cuda(checkpoint):
    """engine.vision_green_sms: the blocks of a pass spread over steps (an encoder budget below the image's cost,
    beside a text request) run on a green context's stream; the tokens are those of the blocks on the step's own
    stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    image = PromptInput([IM_START, VISION_START] + [IMAGE_PAD] * 4 + [VISION_END, 5, 6], [png(64, 64, seed=11)])

    def tokens(sms: int) -> dict[str, list[int]]:
        engine = make_engine(checkpoint, device="cuda", max_num_encoder_tokens=2, vision_green_sms=sms)
        assert engine.executor.tower_stream.active == bool(sms)
        assert engine.scheduler.limits.passes_beside == bool(sms)
        encoded = record_encodes(engine)
        got = run_to_completion(engine, {0: [("img", image), ("text", PromptInput([1, 2, 3, 4, 5, 6, 7, 8]))]})
        assert any(what.startswith("blocks") for _, rid, what in encoded if rid == "img")  # spread over steps
        return got

    assert tokens(64) == tokens(0)


@pytest.mark.gpu
def test_engine_runs_on_cuda_in_bfloat16_with_the_kv_pool_sized_from_free_memory(checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = make_engine(checkpoint, device="cuda", num_kv_blocks=None, gpu_memory_utilization=0.5)
    assert engine.load().total_kv_blocks > 0
    prompt = PromptInput([IM_START, VISION_START] + [IMAGE_PAD] * 4 + [VISION_END, 5, 6], [png(64, 64, seed=0)])
    got = run_to_completion(engine, {0: [("cuda", prompt), ("text", PromptInput([1, 2, 3]))]})
    assert len(got["cuda"]) == NEW_TOKENS and len(got["text"]) == NEW_TOKENS
