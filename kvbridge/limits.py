"""Limits on request bodies, checked before any parser sees them.

Python's ``json`` and msgspec's untyped decoders recurse once per nesting level: 100,000
``[`` raise ``RecursionError`` (a 500 with a traceback) instead of a 400. A linear pre-scan
of the nesting depth is cheap next to decoding, so every JSON body a kvbridge server
decodes goes through ``check_json_body`` first.

The pre-scan must stay linear in the body whatever the body is: it runs on the event loop,
before anything is known about the caller.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Any

import msgspec
from starlette.requests import Request

from kvbridge.errors import RequestError
from kvbridge.settings import SETTINGS

__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "check_json_body",
    "decode_json_body",
    "json_depth",
    "read_json_body",
]


# Largest request body (bytes) the engine API and the proxy decode: a long prompt as text
# or token ids fits many times over.
MAX_BODY_BYTES: int = SETTINGS.from_env("max_body_bytes")  # KVBRIDGE_MAX_BODY_BYTES
# Largest engine answer (bytes) the proxy reads whole: a prefill's, a decode's error body.
MAX_ANSWER_BYTES: int = SETTINGS.from_env("max_answer_bytes")  # KVBRIDGE_MAX_ANSWER_BYTES
# Deepest nesting of arrays/objects accepted; OpenAI requests nest about 5 levels.
MAX_JSON_DEPTH: int = SETTINGS.from_env("max_json_depth")  # KVBRIDGE_MAX_JSON_DEPTH

# A JSON string (escapes included): brackets inside strings do not nest anything. The
# closing quote is optional (an unterminated string runs to the end of the body) and the
# quantifiers are possessive, so every match from a quote succeeds without backtracking and
# consumes what it read: one pass over the body. (With a mandatory closing quote, an
# unterminated string of quote-backslash pairs made the search restart at every quote:
# time quadratic in the body.)
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = bytes.maketrans(b"[]{}", b"\x01\x00\x01\x00")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in ``body`` (0 for a scalar); a
    malformed body gives some number, and the decoder then says what is wrong."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate((1 if b else -1 for b in brackets.translate(_STEP)), initial=0))


def check_json_body(
    body: bytes, *, max_bytes: int | None = None, max_depth: int | None = None
) -> None:
    """Raise ``RequestError`` (413/400, OpenAI's error shape) for a body too large or
    nested too deep to decode safely."""
    max_bytes = MAX_BODY_BYTES if max_bytes is None else max_bytes
    max_depth = MAX_JSON_DEPTH if max_depth is None else max_depth
    if len(body) > max_bytes:
        raise RequestError(
            413,
            f"request body of {len(body)} bytes exceeds the limit of "
            f"{max_bytes} bytes (KVBRIDGE_MAX_BODY_BYTES)",
        )
    depth = json_depth(body)
    if depth > max_depth:
        raise RequestError(
            400,
            f"request body nests {depth} levels deep, more than the "
            f"limit of {max_depth} (KVBRIDGE_MAX_JSON_DEPTH)",
        )


async def read_json_body(
    request: Request, *, max_bytes: int | None = None, max_depth: int | None = None
) -> bytes:
    """A request's body, read no further than the size limit, and checked by
    ``check_json_body``: a body over the limit is refused before it is all in memory."""
    max_bytes = MAX_BODY_BYTES if max_bytes is None else max_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(
            413,
            f"request body of {declared} bytes exceeds the limit of "
            f"{max_bytes} bytes (KVBRIDGE_MAX_BODY_BYTES)",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(
                413,
                f"request body exceeds the limit of {max_bytes} bytes (KVBRIDGE_MAX_BODY_BYTES)",
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    check_json_body(body, max_bytes=max_bytes, max_depth=max_depth)
    return body


def decode_json_body(body: bytes) -> Any:
    """``body`` (checked by ``check_json_body``) decoded as strict JSON: UTF-8 only, no NaN,
    and no lone surrogate escape (``"\\ud800"``), which no UTF-8 encoder can write back:
    a proxy that forwards what it decoded must not hold a string it cannot send. Raises
    ``RequestError`` (400), as an engine's own decoder does for the same body."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
