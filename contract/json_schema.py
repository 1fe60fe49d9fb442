"""The JSON Schemas a request may constrain its output to: which texts the wire's `json_schema` accepts, and the
schema that `response_format {"type": "json_object"}` stands for.

A schema is accepted when llguidance (https://github.com/guidance-ai/llguidance, the worker's guided-decoding
backend, workers/grammar.py) compiles it, so the router refuses a bad one up front with the same rule the worker
applies. Whitespace between JSON tokens is not free: separators are ", " and ": " as json.dumps writes them
(vLLM's `disable-any-whitespace` option), so a model cannot spend its whole budget on blank space inside an object.
"""

from __future__ import annotations

import json

import llguidance

# llguidance's JSON compile options (JsonCompileOptions in its _lib.pyi).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = json.dumps({"type": "object"})  # response_format {"type": "json_object"}


def json_schema_grammar(json_schema: str) -> str:
    """The llguidance grammar for a JSON Schema (JSON text); ValueError saying what llguidance cannot compile."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise ValueError(f"not a JSON Schema: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar
