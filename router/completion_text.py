"""The text an OpenAI client sees for a request's streamed tokens: incremental detokenization, then stop
strings and stop token ids applied as vLLM applies them (vllm/v1/engine/detokenizer.py, stop_checker.py).

The check runs here, in the router, because the router is what detokenizes (workers see only token ids), as
vLLM's front-end process checks stop strings and aborts the request in its engine core: the caller closes the
request's stream on a match, which cancels the worker's request, so no token is computed past the next step.
Stop token ids are checked by the worker's scheduler itself, like EOS.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from contract.tokenizer import QwenTokenizer
from router.detokenize import IncrementalDetokenizer


class CompletionText:
    """Feed each chunk's tokens to add(); take() hands out the text that is final so far.

    vLLM's rules: generation stops once the text contains a stop string (the first one in list order that
    occurs in the newly decoded text); the text ends just before it; while streaming, the last
    max(len(stop)) - 1 characters are held back, so no character past a stop string is ever sent. A stop token
    id ends the text without its own text. stop_reason says which stop string or stop token id ended it."""

    def __init__(self, tokenizer: QwenTokenizer, stop: Sequence[str] = (), stop_token_ids: Collection[int] = (),
                 whole: bool = False):
        """whole: the caller takes the text only once it is final (a reply sent whole); without stop strings the
        tokens are then decoded once, at the end, instead of twice a chunk and once more at the end."""
        self._tokenizer = tokenizer
        self._whole = whole and not stop
        self._detok = None if self._whole else IncrementalDetokenizer(tokenizer)
        self._ids: list[int] = []
        self._stop = list(stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._sent = 0
        self.text = ""
        self.num_tokens = 0  # tokens the text is made of, up to the one that completed a stop string
        self.stop_reason: str | int | None = None

    def add(self, token_ids: Sequence[int], finished: bool) -> bool:
        """The tokens of one chunk (finished: the last chunk). True when a stop string matched: the caller
        must end the request, and drops any tokens after the match."""
        token_ids = list(token_ids)
        if finished and token_ids and token_ids[-1] in self._stop_token_ids:
            self.stop_reason = token_ids.pop()
            self.num_tokens += 1
        if self._whole:  # nothing to look for, nobody reads the text before the end: one decode at the end
            self.num_tokens += len(token_ids)
            self._ids.extend(token_ids)
            if finished:
                self._extend(self._tokenizer.decode(self._ids))
            return False
        if not self._stop:  # nothing to look for: one decode per chunk
            self.num_tokens += len(token_ids)
            self._extend(self._detok.add(token_ids))
        else:
            for token in token_ids:  # one token at a time, so a match says how many tokens it took
                self.num_tokens += 1
                if self._extend(self._detok.add([token])):
                    return True
        return self._extend(self._detok.finish()) if finished else False

    def take(self, final: bool) -> str:
        """Text not handed out yet; until final, without the tail a stop string could still begin in."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        delta, self._sent = self.text[self._sent:end], end
        return delta

    def _extend(self, delta: str) -> bool:
        if not delta:
            return False
        searched = len(self.text)
        self.text += delta
        for stop in self._stop:
            at = self.text.find(stop, max(0, searched - len(stop) + 1))  # text before that was searched already
            if at != -1:
                self.text = self.text[:at]
                self.stop_reason = stop
                return True
        return False
