"""AsyncEngine: the step loop runs on its own thread; asyncio callers stream, abort, and hand KV over."""

from __future__ import annotations

import asyncio

import pytest

from contract.types import FinishReason, PromptInput, SamplingParams
from workers.serve import async_engine
from workers.serve.async_engine import AsyncEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.request_options import NO_OPTIONS, ONLY_AT_END, RequestOptions


@pytest.fixture(scope="module")
def engine(tiny_moe_checkpoint):
    async_engine = AsyncEngine(LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=64, max_model_len=128)))
    yield async_engine
    async_engine.shutdown()


async def collect(engine: AsyncEngine, rid: str, ids: list[int], max_tokens: int, options=NO_OPTIONS):
    return [out async for out in engine.generate(rid, PromptInput(ids), SamplingParams(max_tokens=max_tokens), options)]


def test_concurrent_generates_stream_the_same_tokens_as_one_at_a_time(engine):
    async def main():
        alone = await collect(engine, "alone", [1, 2, 3], 6)
        together = await asyncio.gather(collect(engine, "a", [1, 2, 3], 6), collect(engine, "b", [9, 8], 4))
        return alone, together

    alone, (a, b) = asyncio.run(main())
    assert [t for o in alone for t in o.new_token_ids] == [t for o in a for t in o.new_token_ids]
    assert a[-1].finished and a[-1].num_generated_tokens == 6 and b[-1].num_generated_tokens == 4
    assert engine.load().steps > 0 and engine.generation_defaults.top_k == 20


def test_leaving_a_stream_early_aborts_the_request(engine):
    async def main():
        async for _ in engine.generate("early", PromptInput([1, 2]), SamplingParams(max_tokens=50)):
            break
        for _ in range(100):
            await asyncio.sleep(0.01)
            if engine.load().running_requests == 0 and engine.load().waiting_requests == 0:
                return True
        return False

    assert asyncio.run(main())


def test_abort_ends_the_stream_with_abort(engine):
    async def main():
        outs = []
        async for out in engine.generate("cut", PromptInput([1, 2]), SamplingParams(max_tokens=100)):
            outs.append(out)
            if len(outs) == 2:
                assert await engine.abort("cut")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason is FinishReason.ABORT and outs[-1].num_generated_tokens < 100


def test_prefill_only_kv_is_exported_and_released_through_the_async_api(engine):
    async def main():
        outs = await collect(engine, "pf", [1, 2, 3, 4, 5], 10, RequestOptions(prefill_only=True))
        export = await engine.export_kv("pf")
        released = await engine.release("pf")
        with pytest.raises(KeyError):
            await engine.export_kv("pf")
        return outs, export, released

    outs, export, released = asyncio.run(main())
    assert export.num_tokens == 5 and export.first_token_id == outs[-1].new_token_ids[0] and released


def test_requests_are_prepared_on_the_configured_pool_not_the_loops_executor(engine, monkeypatch):
    """preprocess_threads bounds the preparation threads (more take CPU from the engine's thread)."""
    import threading

    assert engine._prepare_pool._max_workers == engine.engine.config.preprocess_threads == 4
    seen = []
    prepare = engine.engine.prepare_request
    monkeypatch.setattr(engine.engine, "prepare_request", lambda *a, **k: seen.append(threading.current_thread().name) or prepare(*a, **k))
    asyncio.run(collect(engine, "pooled", [1, 2, 3], 2))
    assert len(seen) == 1 and seen[0].startswith("prepare")


def test_a_preparation_pool_of_no_threads_is_refused(tiny_moe_checkpoint):
    with pytest.raises(ValueError, match="preprocess_threads"):
        EngineConfig(checkpoint=tiny_moe_checkpoint, preprocess_threads=0)


def test_a_requests_stream_interval_hands_out_its_first_token_then_bundles_of_that_many(engine):
    async def main():
        return [await collect(engine, rid, [4, 5, 6], 10, RequestOptions(stream_interval=interval))
                for rid, interval in (("every", 0), ("by4", 4), ("at-end", ONLY_AT_END))]

    every, by4, at_end = asyncio.run(main())
    tokens = [t for o in every for t in o.new_token_ids]
    n = len(tokens)
    assert [len(o.new_token_ids) for o in every] == [1] * n
    assert [len(o.new_token_ids) for o in by4] == [1] + [4] * ((n - 1) // 4) + ([(n - 1) % 4] if (n - 1) % 4 else [])
    assert [len(o.new_token_ids) for o in at_end] == [1, n - 1]
    assert [t for o in by4 for t in o.new_token_ids] == tokens == [t for o in at_end for t in o.new_token_ids]
    assert by4[-1].finished and at_end[-1].finished and not any(o.finished for o in by4[:-1])


def test_a_steps_outputs_reach_the_callers_loop_in_one_call(engine, monkeypatch):
    calls = []
    call_in = async_engine._call_in

    def recording(loop, fn, *args):
        if fn is async_engine._put_all:
            calls.append({out.request_id for _, out in args[0]})
        call_in(loop, fn, *args)

    monkeypatch.setattr(async_engine, "_call_in", recording)

    async def main():
        return await asyncio.gather(*(collect(engine, f"s{i}", [7, i + 1], 5) for i in range(3)))

    streams = asyncio.run(main())
    assert all(sum(len(o.new_token_ids) for o in outs) == outs[-1].num_generated_tokens for outs in streams)
    assert max(len(requests) for requests in calls) == 3  # the three requests' outputs of a step, together
