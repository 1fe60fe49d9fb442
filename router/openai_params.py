"""A /v1/chat/completions body -> what the router sends (SamplingParams) and how it answers (stream, stop
strings); every field is checked, and one this endpoint does not implement is refused naming it, never dropped.

Types are strict (a JSON true is not an integer) and ranges are vLLM's (vllm/sampling_params.py _verify_args,
vllm/entrypoints/openai/protocol.py). Accepted: model, messages, max_completion_tokens / max_tokens, temperature,
top_p, top_k, seed, stop, stop_token_ids, response_format (text, json_object, json_schema), stream,
stream_options.include_usage, user; and n, logprobs, top_logprobs, presence_penalty, frequency_penalty at
their no-op values only (1, false, 0, 0, 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from contract.json_schema import ANY_JSON_OBJECT, json_schema_grammar
from contract.wire import pb

_UINT64 = 2**64
_INT32 = 2**31
# Parameters accepted only at the value that asks for nothing: anything else would be silently ignored.
_NO_OP = {"n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_HANDLED = {"model", "messages", "max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed",
            "stop", "stop_token_ids", "response_format", "stream", "stream_options", "user", *_NO_OP}


class BadRequest(ValueError):
    """The request body is not a chat completion request this endpoint serves; param names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    model: str | None  # None: the served model
    messages: list
    sampling: pb.SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]


def parse_chat_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """The checked request; BadRequest naming the first field that is wrong or not supported."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - _HANDLED)
    if unknown:
        raise BadRequest(f"{unknown[0]!r} is not supported by this endpoint", unknown[0])
    for name, no_op in _NO_OP.items():
        value = body.get(name)
        if value is not None and not _is_no_op(value, no_op):
            raise BadRequest(f"{name}={value!r} is not supported by this endpoint (only {json.dumps(no_op)})", name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string", "model")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", "user")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest("stream_options supports only include_usage", "stream_options")
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    return ChatRequest(body.get("model"), messages, _sampling(body, default_max_tokens), stream, include_usage,
                       _stop_strings(body))


def _sampling(body: dict, default_max_tokens: int) -> pb.SamplingParams:
    """With no temperature / top_p / top_k the checkpoint's generation_config.json applies (MLPerf sends none)."""
    given = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, given, 1, _INT32)
    sampling = pb.SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens)
    seed = _int(body, "seed", 0, _UINT64)
    if seed is not None:
        sampling.has_seed, sampling.seed = True, seed
    temperature = _number(body, "temperature", lambda v: v >= 0, "must be >= 0")
    top_p = _number(body, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
    top_k = _int(body, "top_k", -1, _INT32)
    if top_k is not None:
        top_k = max(top_k, 0)  # vLLM's -1 means disabled, like our 0
    if temperature is None and top_p is None and top_k is None:
        sampling.use_model_defaults = True
    else:
        sampling.temperature = 1.0 if temperature is None else temperature
        sampling.top_p = 1.0 if top_p is None else top_p
        sampling.top_k = top_k or 0
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < _INT32 for t in ids):
            raise BadRequest("stop_token_ids must be a list of token ids (integers >= 0)", "stop_token_ids")
        sampling.stop_token_ids.extend(ids)
    schema = _json_schema(body.get("response_format"))
    if schema is not None:
        sampling.json_schema = schema
    return sampling


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    if any(s == "" for s in stops):
        raise BadRequest("stop cannot contain an empty string", "stop")
    return tuple(stops)


def _json_schema(response_format: Any) -> str | None:
    """response_format -> the JSON Schema text the worker's grammar enforces (None for plain text)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text" and set(response_format) == {"type"}:
        return None
    if kind == "json_object" and set(response_format) == {"type"}:
        return ANY_JSON_OBJECT
    if kind == "json_schema" and set(response_format) == {"type", "json_schema"}:
        spec = response_format["json_schema"]
        if not isinstance(spec, dict) or set(spec) - {"name", "description", "schema", "strict"}:
            raise BadRequest("response_format.json_schema takes name, description, schema and strict",
                             "response_format.json_schema")
        if not isinstance(spec.get("schema"), dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON Schema object",
                             "response_format.json_schema.schema")
        text = json.dumps(spec["schema"])
        try:
            json_schema_grammar(text)
        except ValueError as exc:
            raise BadRequest(f"response_format.json_schema.schema: {exc}", "response_format.json_schema.schema") from None
        return text
    raise BadRequest('response_format must be {"type": "text"}, {"type": "json_object"} or '
                     '{"type": "json_schema", "json_schema": {...}}', "response_format")


def _is_no_op(value: Any, no_op: bool | int | float) -> bool:
    if isinstance(no_op, bool):
        return value is no_op
    same_type = _is_int(value) if isinstance(no_op, int) else _is_number(value)
    return same_type and value == no_op


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value < high:
        raise BadRequest(f"{name} must be an integer in [{low}, {high - 1}], got {json.dumps(value)}", name)
    return value


def _number(body: dict, name: str, ok, rule: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):  # "0.5" is a string, not a number below 0: say which rule it breaks
        raise BadRequest(f"{name} must be a number, got {json.dumps(value)}", name)
    if not ok(value):
        raise BadRequest(f"{name} {rule}, got {json.dumps(value)}", name)
    return float(value)


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{param or name} must be true or false, got {json.dumps(value)}", param or name)
    return bool(value)
