"""Incremental detokenization for streaming: turn token ids into text deltas as they arrive.

Decodes a short window of recent tokens and holds back text that ends in an incomplete UTF-8 character.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.tokenizer import QwenTokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: QwenTokenizer):
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""          # everything emitted so far
        self._prefix_offset = 0  # window start: decoding from a token boundary is stable
        self._read_offset = 0    # tokens whose text has been emitted

    def add(self, new_ids: Sequence[int]) -> str:
        """Text that the new tokens complete (may be empty while a multi-byte character is unfinished)."""
        self.ids.extend(new_ids)
        decode = self._tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset : self._read_offset])
        window = decode(self.ids[self._prefix_offset :])
        if len(window) <= len(prefix) or window.endswith(_INCOMPLETE):
            return ""
        delta = window[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text once the stream has ended, so that all deltas add up to decode(ids)."""
        full = self._tokenizer.decode(self.ids)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest
