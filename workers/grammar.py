"""Guided decoding: a request's JSON Schema becomes an llguidance grammar, and each step a mask of the tokens
the grammar allows next. Only requests that carry a schema build any of this; the rest pay nothing.

Why llguidance (https://github.com/guidance-ai/llguidance, one of vLLM's structured-output backends): it
installs as one self-contained wheel with no dependencies (xgrammar 0.2.9 pulls in triton and a TVM FFI package,
which this CPU venv does not otherwise carry), it builds its vocabulary straight from the `tokenizers` JSON of the
real Qwen tokenizer (contract/tokenizer.py), and it computes a mask on the CPU in about a millisecond.
Which schemas compile, and the JSON separators they allow, is the shared contract/json_schema.py.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence

import llguidance
import torch

from contract.json_schema import json_schema_grammar
from contract.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


@functools.cache
def _vocabulary(eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The Qwen vocabulary as llguidance sees it, built once per process (a few seconds)."""
    return llguidance.LLTokenizer(load_tokenizer().to_json(), eos_token=list(eos_token_ids))


class GrammarState:
    """One request's place in its grammar: which tokens may come next, and the tokens taken so far.

    generated: tokens already produced for the request (resumed after a migration, or the first token of an
    imported KV cache); the grammar starts after them."""

    def __init__(self, json_schema: str, eos_token_ids: Iterable[int], generated: Sequence[int] = ()):
        self._eos = sorted(eos_token_ids)
        self._matcher = llguidance.LLMatcher(_vocabulary(tuple(self._eos)), json_schema_grammar(json_schema))
        if self._matcher.is_error():
            raise ValueError(f"json_schema: {self._matcher.get_error()}")
        if generated and not self._matcher.consume_tokens(list(generated)):
            raise ValueError(f"the tokens generated so far do not match the json_schema: {self._matcher.get_error()}")
        self._warned = False

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """bool [vocab_size] (CPU): the tokens the grammar allows next; ids past the tokenizer's are never allowed."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        if self._matcher.is_error():
            # Cannot happen while every token fed in came from this mask; if it does, end the request (EOS)
            # rather than sample from an empty set.
            if not self._warned:
                log.warning("grammar in error state (%s): ending the request", self._matcher.get_error())
                self._warned = True
            mask[self._eos] = True
            return mask
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = ((words.unsqueeze(1) >> _BITS) & 1).flatten().bool()
        n = min(vocab_size, bits.numel())
        mask[:n] = bits[:n]
        return mask

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)
