"""JSON in and out of the HTTP front end: orjson (https://github.com/ijl/orjson) where it gives what the standard
library's json gives, the standard library's json where orjson refuses what json accepts.

orjson parses and writes RFC 8259 JSON several times faster than json, but refuses a few things json takes (NaN and
Infinity literals, strings with lone surrogates: JSON's \\ud800 escapes make one) and reads an integer past 64 bits
as a float. A body orjson refuses, or whose value holds a float that large, is parsed again by json exactly as the
front end parsed every body before (decoded as UTF-8 first), so what json accepted is still accepted, as the same
value, and what it refused is refused with json's own error. A reply orjson cannot write (a stop string that held
a lone surrogate) is written by json, as before.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a dependency (pyproject.toml); the fallback keeps a bare install working
    orjson = None


def loads(body: bytes) -> Any:
    """The JSON value of a request body (UTF-8). ValueError (json.JSONDecodeError, UnicodeDecodeError) if it is not
    one, as json.loads(body.decode()) raises it."""
    if orjson is not None:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
        else:
            if not _holds_huge_float(value):
                return value
    return json.loads(body.decode("utf-8"))


_HUGE = 2.0 ** 64  # orjson reads an integer literal at or past this as a float (json: as an int)


def _holds_huge_float(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        elif kind is float and not -_HUGE < item < _HUGE:
            return True
    return False


def dumps(value: Any) -> bytes:
    """`value` as UTF-8 JSON."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:  # a str with a lone surrogate, an integer past 64 bits
            pass
    return json.dumps(value).encode("utf-8")
