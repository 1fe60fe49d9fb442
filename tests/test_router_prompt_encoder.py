"""The router's tiktoken prompt encoder gives the `tokenizers` build's token ids, text by text and chat by chat."""

from __future__ import annotations

import random

import pytest

from contract import tokenizer as qt
from contract.chat import encode_chat
from router.prompt_encoder import PromptEncoder
from tests.helpers.tokenizer_texts import TEXTS

SPECIAL_TEXTS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|vision_start|><|image_pad|><|vision_end|>Describe the product.",
    "<|vision_start|>" + "<|image_pad|>" * 37 + "<|vision_end|>",
    "<think>\n\n</think>\n\n<tool_call>{\"a\": 1}</tool_call><tool_response>ok</tool_response>",
    "a<|im_end|>b<|endoftext|>c<|video_pad|><|vision_pad|><|fim_prefix|>x<|fim_middle|>y<|fim_suffix|><|fim_pad|>",
    "<|object_ref_start|>mug<|object_ref_end|><|box_start|>(1,2)<|box_end|><|quad_start|><|quad_end|>",
    "<|repo_name|>r<|file_sep|>f",
    "half-written specials: <|im_start <|im_start| <im_start|> <<|im_end|>> |>",
    "<|im_start|><|im_start|><|im_end|><|im_end|>",
    " ".join(["describe"] * 300),
]

# Not NFC: decomposed accents, a combining mark after an added token's '>' (NFC would make it U+226F), singletons.
NON_NFC = ["cafe\u0301 e\u0301", "A\u030a", "<|im_end|>\u0338 x", "\u212b ohm \u2126", "q\u0307\u0323"]


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder()


@pytest.fixture(scope="module")
def tok() -> qt.QwenTokenizer:
    return qt.load_tokenizer()


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS)
def test_token_ids_are_the_tokenizers_builds(encoder, tok, text):
    assert encoder.encode(text) == tok.encode(text)


def test_added_tokens_written_in_the_text_get_their_ids(encoder):
    for offset, (content, _) in enumerate(qt.ADDED_TOKENS):
        assert encoder.encode(f"x{content}y") == [*encoder.encode("x"), qt.NUM_BPE_TOKENS + offset, *encoder.encode("y")]


@pytest.mark.parametrize("text", NON_NFC)
def test_text_that_is_not_nfc_goes_to_the_tokenizers_build(text, tok):
    encoder = PromptEncoder()
    assert encoder.encode(text) == tok.encode(text)
    assert encoder.fallbacks == 1
    assert encoder.encode("plain ascii") == tok.encode("plain ascii") and encoder.fallbacks == 1


def test_random_texts_of_mixed_scripts_whitespace_and_specials(encoder, tok):
    rng = random.Random(35)
    parts = ["abc", "XYZ", "123", "4", "é", "ü", "中", "文", "😀", "👩‍👩‍👧", "\n", "\r\n", "\t", " ", " ", "  ", "'s", "'LL",
             ".,!?", "-_", "\u3000", "\u00a0", "\u2028", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|", "|>", "ﬁ",
             "①", "Ω", "ß", "İ", "ǅ"]
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(1, 60))) for _ in range(1500)]
    texts += ["".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 40))) for _ in range(500)]
    planes = [c for c in range(0x3000, 0x1FAFF) if not 0xD800 <= c < 0xE000]  # no lone surrogates: not text
    texts += ["".join(chr(rng.choice(planes)) for _ in range(rng.randint(1, 20))) for _ in range(300)]
    mismatched = [t for t in texts if encoder.encode(t) != tok.encode(t)]
    assert mismatched == []


def test_a_lone_surrogate_is_refused_as_the_tokenizers_build_refuses_it(tok):
    encoder = PromptEncoder(tok)
    with pytest.raises(TypeError):
        tok.encode("a\ud800b")
    with pytest.raises(TypeError):
        encoder.encode("a\ud800b")
    assert encoder.fallbacks == 1


def test_encode_batch_and_decode_are_the_tokenizers(encoder, tok):
    texts = TEXTS[:5] + SPECIAL_TEXTS[:3]
    assert encoder.encode_batch(texts) == tok.encode_batch(texts)
    ids = tok.encode(SPECIAL_TEXTS[0] + TEXTS[5])
    assert encoder.decode(ids) == tok.decode(ids)
    assert encoder.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


def test_a_chat_with_images_encodes_to_the_same_prompt(encoder, tok):
    from tests.helpers.image_fixtures import png_data_url as data_url

    messages = [
        {"role": "system", "content": "You classify products. Answer in JSON."},
        {"role": "user", "content": [
            {"type": "text", "text": "Title: Men's polo ✨\nDescription: <p>Soft cotton</p>\nCategories: Café > Mugs"},
            {"type": "image_url", "image_url": {"url": data_url((64, 48))}},
            {"type": "text", "text": "and this one:"},
            {"type": "image_url", "image_url": {"url": data_url((320, 200))}},
        ]},
    ]
    ours, theirs = encode_chat(messages, encoder), encode_chat(messages, tok)
    assert ours.token_ids == theirs.token_ids and ours.images == theirs.images
    assert qt.token_runs(ours.token_ids) == qt.token_runs(theirs.token_ids) and len(qt.token_runs(ours.token_ids)) == 2


def test_the_http_front_end_encodes_with_it():
    from tests.helpers.router_fixtures import Cluster, run

    async def body():
        async with Cluster(config={"http_listen": "127.0.0.1:0"}) as c:
            assert isinstance(c.router._http.tokenizer, PromptEncoder)

    run(body())


# -- the cache of pieces between added tokens ----------------------------------------------------------------------

BOUNDARY_TEXTS = [  # text against an added token on either side: no BPE merge or regex match may cross it
    "x<|im_end|>y", "  <|im_end|>  ", "\n\n<|im_start|>\n\n", "'s<|im_end|>'s", "don<|im_end|>'t", "123<|im_end|>456",
    "a <|image_pad|> b", " <|vision_start|><|image_pad|><|vision_end|> ", "!!<|im_end|>!!", "\t<|im_end|>\t\n",
    "<|im_start|>user\n", "<|im_start|>user\n ", "<|im_start|>assistant\n<|im_end|>", "é<|im_end|>é", "中<|im_end|>文",
]


def test_a_text_encoded_again_gets_the_same_ids_as_tiktoken_uncached(tok):
    encoder = PromptEncoder(tok)
    rng = random.Random(32)
    parts = ["describe", " ", "  ", "\n", "'s", "é", "中", "😀", "12", ".", "<|im_start|>", "<|im_end|>", "<|image_pad|>",
             "<|vision_start|>", "<|vision_end|>", "user\n", "assistant\n", "<|"]
    texts = BOUNDARY_TEXTS + SPECIAL_TEXTS + ["".join(rng.choice(parts) for _ in range(rng.randint(1, 40)))
                                              for _ in range(400)]
    uncached = [encoder._encoding.encode(t, allowed_special="all") for t in texts]
    for _ in range(2):  # cold, then each piece from the cache (or evicted by the other texts' pieces and encoded again)
        assert [encoder.encode(t) for t in texts] == uncached
        assert [encoder.encode(t) for t in reversed(texts)] == uncached[::-1]
    assert [encoder.encode(t) for t in BOUNDARY_TEXTS] == [tok.encode(t) for t in BOUNDARY_TEXTS]


def test_a_chats_fixed_pieces_are_encoded_once_and_then_read_from_the_cache(tok):
    from contract.prompt import system_prompt

    encoder = PromptEncoder(tok)
    chat = f"<|im_start|>system\n{system_prompt()}<|im_end|>\n<|im_start|>user\nTitle: a mug<|im_end|>\n" \
           "<|im_start|>assistant\n"
    first = encoder.encode(chat)
    cold = encoder.piece_cache_info()
    assert encoder.encode(chat) == first == tok.encode(chat)
    warm = encoder.piece_cache_info()
    assert warm.misses == cold.misses and warm.hits - cold.hits == 6  # "", system, "\n", user, "\n", assistant


def test_the_ids_handed_out_are_the_callers_to_change(tok):
    encoder = PromptEncoder(tok)
    for text in ("hello there", "<|im_start|>user\nhello<|im_end|>"):
        ids = encoder.encode(text)
        expected = list(ids)
        ids[1:3] = [0]
        ids.append(7)
        assert encoder.encode(text) == expected


def test_the_cache_holds_a_bounded_number_of_pieces_and_none_longer_than_the_bound(tok):
    from router import prompt_encoder

    encoder = PromptEncoder(tok)
    for n in range(3 * prompt_encoder.CACHED_PIECES):
        assert encoder.encode(f"<|im_start|>piece {n}") == tok.encode(f"<|im_start|>piece {n}")
    assert encoder.piece_cache_info().currsize == prompt_encoder.CACHED_PIECES
    long_text = "word " * (prompt_encoder.CACHED_PIECE_CHARS // 5 + 1)
    before = encoder.piece_cache_info()
    assert encoder.encode(long_text) == encoder.encode(long_text) == tok.encode(long_text)
    after = encoder.piece_cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)


def test_no_added_token_is_a_prefix_of_another():  # so the split finds the one tiktoken finds, in any order
    added = [content for content, _ in qt.ADDED_TOKENS]
    assert [(a, b) for a in added for b in added if a != b and b.startswith(a)] == []


# -- decoding ------------------------------------------------------------------------------------------------------


def test_decoded_text_is_the_tokenizers_builds_for_any_ids(encoder, tok):
    rng = random.Random(36)
    past_vocab = range(qt.NUM_BPE_TOKENS + len(qt.ADDED_TOKENS), tok.vocab_size + 300)
    cases = [[], [encoder.encode("中")[0]], encoder.encode("😀 é 中文")[:-1], [qt.IM_START_ID], [qt.IMAGE_PAD_ID, 9]]
    cases += [[rng.randrange(qt.NUM_BPE_TOKENS) for _ in range(rng.randint(1, 30))] for _ in range(3000)]  # some UTF-8
    cases += [[rng.choice([rng.randrange(qt.NUM_BPE_TOKENS), rng.randrange(qt.NUM_BPE_TOKENS, past_vocab.stop)])
               for _ in range(rng.randint(1, 10))] for _ in range(300)]  # with added tokens and ids past the vocabulary
    for skip in (True, False):
        assert [c for c in cases if encoder.decode(c, skip) != tok.decode(c, skip)] == []


class _CountingTokenizer:
    """The `tokenizers` build, counting the decodes asked of it."""

    def __init__(self, tok: qt.QwenTokenizer):
        self._tok, self.decodes = tok, 0
        self.eos_token_ids, self.vocab_size = tok.eos_token_ids, tok.vocab_size

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return self._tok.decode(ids, skip_special_tokens)


def test_ids_of_the_bpe_vocabulary_that_make_utf8_are_decoded_without_the_tokenizers_build(tok):
    counting = _CountingTokenizer(tok)
    encoder = PromptEncoder(counting)
    assert encoder.decode(encoder.encode("A reply, déjà vu 中文 😀")) == "A reply, déjà vu 中文 😀"
    assert counting.decodes == 0
    assert encoder.decode(encoder.encode("<|im_end|>done")) == "done" and counting.decodes == 1  # an added token
    half = encoder.encode("龘")[:1]  # the first of its two tokens
    assert encoder.decode(half) == tok.decode(half) and counting.decodes == 2  # bytes that are not UTF-8 (yet)
