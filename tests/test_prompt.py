"""Chat template rendering (contract/chat.py) and the MLPerf prompt text in both variants (contract/prompt.py)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import pytest
from PIL import Image

from contract import chat
from contract import prompt as mp
from contract.dataset import CatalogueSample
from contract.tokenizer import IM_END_ID, IM_START_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, load_tokenizer
from contract.vision_geometry import image_geometry

# ProductMetadata.model_json_schema() as the reference's task.py (ShopifyGlobalCatalogue.formulate_loaded_sample)
# renders it; ProductMetadata is defined in
# https://github.com/mlcommons/inference/blob/master/multimodal/qwen3-vl/src/mlperf_inf_mm_q3vl/schema.py
REFERENCE_SCHEMA = json.loads(r"""
{"additionalProperties": false,
 "description": "Json format for the expected responses from the VLM.",
 "properties": {
  "category": {"description": "The complete category of the product, e.g.,\n\"Clothing & Accessories > Clothing > Shirts > Polo Shirts\".\nEach categorical level is separated by \" > \".", "title": "Category", "type": "string"},
  "brand": {"description": "The brand of the product, e.g., \"giorgio armani\".", "title": "Brand", "type": "string"},
  "is_secondhand": {"description": "True if the product is second-hand, False otherwise.", "title": "Is Secondhand", "type": "boolean"}},
 "required": ["category","brand","is_secondhand"], "title": "ProductMetadata", "type": "object"}
""")

REFERENCE_SYSTEM_HEAD = """Please analyze the product from the user prompt
and provide the following fields in a valid JSON object:
- category
- brand
- is_secondhand

You must choose only one, which is the most appropriate, correct, and specifc
category out of the list of possible product categories.

The description of the product sometimes contains various types of source code
(e.g., JavaScript, CSS, HTML, etc.), where useful product information is embedded
somewhere inside the source code. For this task, you should extract the useful
product information from the source code and leverage it, and discard the
programmatic parts of the source code.

Your response should only contain a valid JSON object and nothing more, e.g.,
you should not fence the JSON object inside a ```json code block.
The JSON object should match the followng JSON schema:
```json
"""


def _png(size=(64, 64)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(size=(640, 480)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 120, 30)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture()
def sample() -> CatalogueSample:
    return CatalogueSample(
        index=7, title="Men's polo ✨", description="<p>Soft cotton</p>", image_bytes=_jpeg(),
        image_format="JPEG", categories=["Apparel > Men's Shirts", "Apparel > Shirts > Polo Shirts", "Café > Mugs"],
        gt_brand="giorgio armani", gt_is_secondhand=False, gt_category="Apparel > Shirts > Polo Shirts")


# ---- contract/prompt.py ------------------------------------------------------------------------------------------

def test_reference_schema_text_is_pydantic_output_and_the_documented_schema():
    text = mp.schema_text("v6.0")
    assert text == json.dumps(mp.ProductMetadata.model_json_schema(), indent=2)
    assert json.loads(text) == REFERENCE_SCHEMA
    assert text == json.dumps(REFERENCE_SCHEMA, indent=2)  # same key order, same bytes


def test_v61_schema_has_no_field_descriptions():
    schema = json.loads(mp.schema_text("v6.1"))
    assert schema["title"] == "ProductMetadata" and schema["additionalProperties"] is False
    assert all("description" not in field for field in schema["properties"].values())
    assert schema["description"].startswith("JSON format for expected VLM responses")


def test_reference_system_prompt_is_verbatim_with_its_typos():
    system = mp.system_prompt("v6.0")
    assert system == REFERENCE_SYSTEM_HEAD + mp.schema_text("v6.0") + "\n```\n"


def test_v61_system_prompt_fixes_the_typos():
    system = mp.system_prompt("v6.1")
    assert "specifc" not in system and "followng" not in system
    assert "correct, and specific\ncategory" in system and "match the following JSON schema" in system
    assert system.endswith(mp.schema_text("v6.1") + "\n```\n")


def test_user_text_lists_categories_as_python_repr_in_v60_and_json_in_v61(sample):
    v60 = mp.user_text(sample, "v6.0")
    assert v60 == (
        "The title of the product is the following:\n```text\nMen's polo ✨\n```\n\n"
        "The description of the product is the following:\n```text\n<p>Soft cotton</p>\n```\n\n"
        "The following are the possible product categories:\n```json\n"
        "[\"Apparel > Men's Shirts\", 'Apparel > Shirts > Polo Shirts', 'Café > Mugs']\n```\n")
    v61 = mp.user_text(sample, "v6.1")
    assert v61.endswith('```json\n["Apparel > Men\'s Shirts", "Apparel > Shirts > Polo Shirts", '
                        '"Caf\\u00e9 > Mugs"]\n```\n')


def test_null_description_reads_none_as_in_the_reference(sample):
    assert "```text\nNone\n```" in mp.user_text(dataclasses.replace(sample, description=None))


def test_build_messages_sends_the_original_image_bytes_as_a_data_url(sample):
    messages = mp.build_messages(sample, "v6.0")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == mp.system_prompt("v6.0")
    text_part, image_part = messages[1]["content"]
    assert text_part == {"type": "text", "text": mp.user_text(sample, "v6.0")}
    url = image_part["image_url"]["url"]
    assert url.startswith("data:image/JPEG;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == sample.image_bytes


def test_build_prompt_equals_encoding_the_openai_messages(sample, tok):
    for variant in ("v6.0", "v6.1"):
        direct = mp.build_prompt(sample, tok, variant)
        via_messages = chat.encode_chat(mp.build_messages(sample, variant), tok)
        assert direct == via_messages
        assert direct.images == [sample.image_bytes]


def test_build_prompt_tokens_are_the_rendered_template(sample, tok):
    prompt = mp.build_prompt(sample, tok, "v6.0")
    n = image_geometry(sample.image_bytes).num_tokens
    assert n == 300  # 640x480
    expected_text = ("<|im_start|>system\n" + mp.system_prompt("v6.0") + "<|im_end|>\n<|im_start|>user\n"
                     + mp.user_text(sample, "v6.0") + "<|vision_start|>" + "<|image_pad|>" * n
                     + "<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    assert chat.prompt_text(mp.build_messages(sample, "v6.0")) == expected_text
    assert prompt.token_ids == tok.encode(expected_text)


def test_prompt_builder_batch_matches_single_builds_and_reports_bad_images(sample, tok):
    broken = dataclasses.replace(sample, index=9, image_bytes=b"\xff\xd8\xff not really a jpeg")
    builder = mp.PromptBuilder(tok, "v6.1")
    good, bad = builder.build_batch([sample, broken])
    assert good == builder(sample)
    assert isinstance(bad, ValueError) and str(bad).startswith("sample 9:")
    with pytest.raises(ValueError, match="sample 9"):
        builder(broken)


def test_a_bad_image_sample_gets_the_same_message_on_every_build(sample, tok):
    broken = dataclasses.replace(sample, index=9, image_bytes=b"GIF89a but no more")
    builder = mp.PromptBuilder(tok, "v6.1")
    first, second = (str(builder.build_batch([broken])[0]) for _ in range(2))
    assert first == second
    assert first.startswith("sample 9:") and "18 bytes" in first and " at 0x" not in first


def test_unknown_variant_is_refused(tok):
    with pytest.raises(ValueError, match="v6.2"):
        mp.PromptBuilder(tok, "v6.2")


# ---- contract/chat.py --------------------------------------------------------------------------------------------

def test_user_turn_renders_parts_in_order_with_expanded_image_pads(tok):
    png, jpeg = _png(), _jpeg()
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [
            {"type": "image", "image": png},
            {"type": "text", "text": "Compare with"},
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()}},
        ]},
    ]
    n_png, n_jpeg = image_geometry(png).num_tokens, image_geometry(jpeg).num_tokens
    assert n_png == 64  # small images are raised to min_pixels
    prompt = chat.encode_chat(messages, tok)
    assert prompt.images == [png, jpeg]
    ids = prompt.token_ids
    assert ids[:3] == [IM_START_ID, 8948, 198]  # <|im_start|>system\n
    assert ids[-5:] == [IM_END_ID, 198, IM_START_ID, 77091, 198]  # ...<|im_end|>\n<|im_start|>assistant\n
    first = ids.index(VISION_START_ID)
    assert ids[first + 1:first + 1 + n_png] == [IMAGE_PAD_ID] * n_png and ids[first + 1 + n_png] == VISION_END_ID
    assert ids.count(IMAGE_PAD_ID) == n_png + n_jpeg
    assert chat.prompt_text(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{'<|image_pad|>' * n_png}<|vision_end|>Compare with"
        f"<|vision_start|>{'<|image_pad|>' * n_jpeg}<|vision_end|><|im_end|>\n<|im_start|>assistant\n")


def test_multi_turn_text_chat_renders_assistant_turns(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "北京?"}]
    text = chat.prompt_text(messages)
    assert text == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>user\n北京?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.encode_chat(messages, tok).token_ids == tok.encode(text)


def test_min_max_pixels_change_the_visual_token_count(tok):
    jpeg = _jpeg((1024, 1024))
    messages = [{"role": "user", "content": [{"type": "image", "image": jpeg}]}]
    full = chat.encode_chat(messages, tok).token_ids.count(IMAGE_PAD_ID)
    capped = chat.encode_chat(messages, tok, max_pixels=512 * 512).token_ids.count(IMAGE_PAD_ID)
    assert (full, capped) == (1024, 256)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}}]}],
         "remote image URLs are not fetched"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}],
         "bad base64"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
         "unsupported image URL scheme"),
        ([{"role": "system", "content": [{"type": "image", "image": b"x"}]}, {"role": "user", "content": "hi"}],
         r"messages\[0\]\.content\[0\]: images are only allowed in user messages"),
        ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}], "only allowed first"),
        ([{"role": "tool", "content": "x"}], "unsupported role"),
        ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], "unsupported content part"),
        ([{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}], "image 0: cannot read"),
        ([], "empty"),
    ],
)
def test_bad_requests_raise_a_value_error_naming_the_problem(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        chat.encode_chat(messages, tok)


def test_text_that_spells_an_image_pad_without_an_image_is_refused(tok):
    with pytest.raises(ValueError, match="1 <\\|image_pad\\|> tokens but 0 images"):
        chat.encode_chat([{"role": "user", "content": "look: <|image_pad|>"}], tok)
