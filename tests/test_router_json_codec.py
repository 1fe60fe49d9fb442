"""The HTTP front end's JSON (router/json_codec.py): orjson's speed, the standard library's answers: what json
accepted is accepted (NaN, lone surrogates, big integers), what it refused is refused with its error."""

from __future__ import annotations

import json

import pytest

from router import json_codec


@pytest.mark.parametrize("text", [
    '{"messages": [{"role": "user", "content": "h\\u00e9llo \\ud83d\\ude00"}], "max_tokens": 7, "t": 0.5}',
    '{"a": NaN, "b": Infinity}',  # json's extensions, refused by orjson
    '{"stop": ["\\ud800"]}',  # a lone surrogate
    '{"n": 123456789012345678901234567890}',  # past 64 bits
    '[1, 2, {"x": null, "y": true}]',
])
def test_loads_gives_what_json_gives(text):
    got, want = json_codec.loads(text.encode()), json.loads(text)
    assert repr(got) == repr(want)  # repr: NaN != NaN


@pytest.mark.parametrize("body, error", [
    (b"", json.JSONDecodeError),
    (b"{not json", json.JSONDecodeError),
    (b'{"a": 1} x', json.JSONDecodeError),
    (b'{"a": "\xff"}', UnicodeDecodeError),
])
def test_loads_refuses_what_json_refused_with_its_error(body, error):
    with pytest.raises(error) as raised:
        json_codec.loads(body)
    if error is json.JSONDecodeError:
        with pytest.raises(json.JSONDecodeError) as want:
            json.loads(body.decode())
        assert str(raised.value) == str(want.value)


@pytest.mark.parametrize("value", [
    {"id": "chatcmpl-1", "choices": [{"message": {"content": "h\u00e9llo \U0001f600"}}], "n": 3, "f": 0.1},
    {"stop_reason": "\ud800"},  # orjson cannot write it; json can
    {"n": 2 ** 70},
])
def test_dumps_writes_utf8_json_that_reads_back_as_the_value(value):
    out = json_codec.dumps(value)
    assert isinstance(out, bytes)
    assert json.loads(out.decode("utf-8")) == value
