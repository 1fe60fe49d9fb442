"""Sampler: picks each sequence's next token from its logits (greedy, or temperature/top-k/top-p).

A request with a seed draws from its own torch.Generator, so its tokens do not depend on its batch mates.
A request with a grammar (workers/grammar.py) has every token outside its grammar's mask removed first.

On CUDA a step's sampling queues behind its forward without the host waiting for the GPU (but for grammar rows,
whose masks need the tokens): the rows' parameters reach the device from page-locked memory (host_copy), and a
draw is torch.multinomial's own exponential race (draw) without the validity checks that read two values back to
the host before it (aten/src/ATen/native/Distributions.cpp, https://github.com/pytorch/pytorch). The released
checkpoints' defaults sample (generation_config.json: temperature 0.7, top-p 0.8, top-k 20), and MLPerf asks for
them: with a wait there, every step's launch blocked until its forward had run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from contract.types import SamplingParams
from workers.host_copy import to_device

if TYPE_CHECKING:
    from workers.grammar import GrammarState


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._seeded.get(request_id)
        if gen is None:
            gen = self._seeded[request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return gen

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
        grammars: Sequence[GrammarState | None] = (),
    ) -> torch.Tensor:
        """logits [B, V] -> token ids [B] on the logits' device; greedy rows wait for nothing on the host.

        grammars: per row, the request's GrammarState or None. Only when some row has one does the step build a
        mask, and wait for the sampled tokens on the host to advance those grammars.

        A batch of greedy rows takes the argmax of the logits in their own dtype: widening bf16 to float32 is exact
        and keeps their order and ties, so the tokens are float32's, without writing a float32 copy of [B, V] (at
        batch 256 of the 151,936-token vocabulary, 233 MB moved: 121 us of a decode step in run151's profile)."""
        if not all(p.greedy for p in params):
            logits = logits.float()
        constrained = [i for i, g in enumerate(grammars) if g is not None]
        if constrained:
            idx = torch.tensor(constrained, device=logits.device)
            allowed = torch.stack([grammars[i].allowed(logits.shape[-1]) for i in constrained]).to(logits.device)
            logits = logits.index_put((idx,), logits[idx].masked_fill(~allowed, float("-inf")))
        tokens = self._pick(logits, request_ids, params)
        if constrained:
            for i, token in zip(constrained, tokens[idx].tolist()):
                grammars[i].accept(token)
        return tokens

    def _pick(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = to_device(torch.tensor(rows), logits.device)
            probs, candidates, top_k = _candidates(logits[idx], [params[i] for i in rows])
            # Rows without a seed share one generator and one draw; a seeded row draws over its own top-k
            # only, so its tokens do not depend on its batch mates.
            shared = [j for j, i in enumerate(rows) if params[i].seed is None]
            if shared:
                pick = to_device(torch.tensor(shared), logits.device)
                choice = draw(probs[pick], self._shared)
                tokens[idx[pick]] = candidates[pick].gather(1, choice).squeeze(1)
            for j, i in enumerate(rows):
                if params[i].seed is not None:
                    gen = self._generator(request_ids[i], params[i])
                    # gathered: an index that is a 0-d tensor is read back to the host (aten/src/ATen/TensorIndexing.h)
                    tokens[i] = candidates[j].gather(0, draw(probs[j, : top_k[j]], gen))[0]
        return tokens


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """torch.multinomial(probs, 1, generator=generator) for probabilities known to be valid (finite, >= 0, a positive
    sum a row): the same exponential race on the same draws from the generator (argmax of p / q, q ~ Exp(1)), so
    the same tokens, without multinomial's checks of probs, which wait for the GPU."""
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax(dim=-1, keepdim=True)


def _candidates(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Per row, the probabilities [B, C] of candidate tokens [B, C] (best first) and its top-k: softmax
    of logits / temperature over the row's top-k, cut to the top-p nucleus (the best token always stays)."""
    dev = logits.device
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if max(top_k) < vocab:
        values, candidates = logits.topk(max(top_k), dim=-1)  # sorted; cheap when every row has a top-k
    else:
        values, candidates = logits.sort(dim=-1, descending=True)
    temperature = to_device(torch.tensor([p.temperature for p in params]), dev).unsqueeze(1)
    values = values / temperature
    ranks = torch.arange(values.shape[1], device=dev).unsqueeze(0)
    drop = ranks >= to_device(torch.tensor(top_k), dev).unsqueeze(1)
    probs = values.masked_fill(drop, float("-inf")).softmax(dim=-1)
    top_p = to_device(torch.tensor([p.top_p for p in params]), dev).unsqueeze(1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p
    return values.masked_fill(drop, float("-inf")).softmax(dim=-1), candidates, top_k
