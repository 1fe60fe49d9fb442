"""Sampler: picks each sequence's next token from its logits (greedy, or temperature/top-k/top-p).

A request with a seed draws from its own torch.Generator, so its tokens do not depend on its batch mates.
"""

from __future__ import annotations

import torch

from workers.types import SamplingParams


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
    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits [B, V] -> one token id per row."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            probs = _filtered_probs(logits[idx], [params[i] for i in rows])
            for j, i in enumerate(rows):
                gen = self._generator(request_ids[i], params[i])
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of logits / temperature restricted to each row's top-k and top-p nucleus."""
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return filtered.softmax(dim=-1)
