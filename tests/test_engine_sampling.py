"""Sampling: greedy, temperature with top-k/top-p, and per-request seeds that make tokens independent of
the batch a request happens to share."""

from __future__ import annotations

import pytest
import torch

from contract.types import PromptInput, SamplingParams
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sampler import Sampler


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2, 1)
    sampler = Sampler(torch.device("cpu"), seed=0)
    top_k = SamplingParams(temperature=1.0, top_k=2)
    top_p = SamplingParams(temperature=1.0, top_p=0.5)  # p(4.0) = 0.64 > 0.5: only the best token
    for _ in range(20):
        a, b = sampler.sample(logits, ["k", "p"], [top_k, top_p]).tolist()
        assert a in (0, 1) and b == 0


def test_greedy_picks_the_argmax():
    sampler = Sampler(torch.device("cpu"), seed=0)
    assert sampler.sample(torch.tensor([[0.1, 2.0, 0.3]]), ["g"], [SamplingParams()]).tolist() == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_are_the_float32_argmax_whatever_the_logits_dtype_first_of_tied_maxima(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 151936, generator=gen) * 8).to(dtype)
    logits[1, 70000] = logits[1, 90000] = logits[1].max() + 1  # tied at the top: the lower id
    sampler = Sampler(torch.device("cpu"), seed=0)
    got = sampler.sample(logits, [f"r{i}" for i in range(6)], [SamplingParams()] * 6)
    assert got.tolist() == logits.float().argmax(dim=-1).tolist() and got[1] == 70000


def test_a_draw_picks_what_torch_multinomial_picks_from_the_same_generator():
    """sampler.draw is multinomial's exponential race without its checks (which wait for a GPU): the same draws
    from the generator give the same tokens, a row at a time or in a batch."""
    from workers.sampler import draw

    probs = torch.rand(64, 20, generator=torch.Generator().manual_seed(1)) ** 4
    probs[3, 1:] = 0.0  # a row with one candidate left (the top-p cut)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(20):
        got, want = draw(probs, ours), torch.multinomial(probs, 1, generator=theirs)
        assert torch.equal(got, want) and got[3, 0] == 0
        assert torch.equal(draw(probs[5, :7], ours), torch.multinomial(probs[5, :7], 1, generator=theirs))
    assert len({tuple(draw(probs, ours).flatten().tolist()) for _ in range(5)}) > 1  # it does draw


def test_a_grammar_masks_only_its_own_row_and_advances_with_the_sampled_token():
    from contract.tokenizer import EOS_TOKEN_IDS, load_tokenizer
    from workers.grammar import GrammarState

    tok = load_tokenizer()
    grammar = GrammarState('{"enum": ["red"]}', EOS_TOKEN_IDS)
    logits = torch.zeros(2, 151936)
    logits[:, tok.encode("blue")[0]] = 5.0  # the best token by far, but not one the grammar allows
    sampler = Sampler(torch.device("cpu"), seed=0)
    picked = []
    for _ in range(8):
        free, constrained = sampler.sample(logits, ["free", "json"], [SamplingParams()] * 2, [None, grammar]).tolist()
        assert free == tok.encode("blue")[0]
        picked.append(constrained)
        if constrained in EOS_TOKEN_IDS:
            break
    assert tok.decode(picked) == '"red"' and picked[-1] in EOS_TOKEN_IDS


@pytest.fixture(scope="module")
def engine(tiny_moe_checkpoint):
    return LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=64, max_model_len=128))


def generate(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    got = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, PromptInput(ids), params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=1234)
    alone = generate(engine, {"s": ([1, 2, 3], seeded)})["s"]
    batch = generate(engine, {
        "noise": ([7, 8, 9, 10], SamplingParams(temperature=1.0, max_tokens=8)),
        "s": ([1, 2, 3], seeded),
    })["s"]
    assert alone == batch and len(alone) == 8


def test_different_seeds_give_different_tokens(engine):
    runs = generate(engine, {
        f"seed{s}": ([1, 2, 3], SamplingParams(temperature=1.5, top_k=100, max_tokens=8, seed=s)) for s in range(3)
    })
    assert len({tuple(t) for t in runs.values()}) > 1


def test_top_k_of_one_equals_greedy(engine):
    got = generate(engine, {
        "greedy": ([4, 5, 6], SamplingParams(max_tokens=8)),
        "k1": ([4, 5, 6], SamplingParams(temperature=0.8, top_k=1, max_tokens=8)),
    })
    assert got["greedy"] == got["k1"]


def test_generation_defaults_come_from_generation_config(engine):
    defaults = engine.generation_defaults
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.8, 20)
    assert engine.eos_token_ids == {151645, 151643}
