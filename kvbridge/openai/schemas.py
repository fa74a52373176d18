"""The OpenAI requests an engine accepts, and every check made of them before the prompt is
tokenized. No engine (and no torch) import: the proxy runs the same checks.

Unknown fields are ignored, known ones are type-checked; ``kv_transfer_params`` strictly.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

from kvbridge.errors import InvalidKVTransferParams, RequestError
from kvbridge.limits import check_json_body
from kvbridge.params import KVTransferParams

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CommonRequest",
    "CompletionRequest",
    "StreamOptions",
    "chat_max_tokens",
    "check_request",
    "parse_request",
    "sampling_settings",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class CommonRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    ignore_eos: bool = False
    kv_transfer_params: KVTransferParams | None = None


class CompletionRequest(CommonRequest, kw_only=True):
    prompt: str | list[int | str | list[int]]


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(CommonRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def check_request(body: dict[str, Any], chat: bool) -> None:
    """Every check an engine makes of a request before it tokenizes the prompt: the schema
    (types, ``kv_transfer_params``) and the sampling settings, on a body already decoded
    (and size- and depth-checked). Raises ``RequestError``.

    The proxy runs it before the prefill hop, so that a request the decode would refuse
    never makes a prefill compute and hold KV that nobody reads.
    """
    req = _checked(_convert(lambda schema: msgspec.convert(body, type=schema), chat), chat)
    if chat:
        param, max_tokens = chat_max_tokens(req)
    else:
        param, max_tokens = "max_tokens", req.max_tokens
    sampling_settings(req, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
                      param)


def parse_request(body: bytes, chat: bool) -> Any:
    """The request decoded and checked (``ChatCompletionRequest`` or ``CompletionRequest``)."""
    check_json_body(body)  # msgspec recurses per level: a deep body must not reach it
    return _checked(_convert(lambda schema: msgspec.json.decode(body, type=schema), chat), chat)


def _convert(decode: Callable[[type], Any], chat: bool) -> Any:
    """``decode(schema)``, its errors as the 400 an engine answers."""
    try:
        return decode(ChatCompletionRequest if chat else CompletionRequest)
    except msgspec.ValidationError as e:
        m = re.search(r"at `\$\.([A-Za-z_]+)", str(e))
        param = m.group(1) if m else None
        what = "kv_transfer_params" if param == "kv_transfer_params" else "request"
        raise RequestError(400, f"invalid {what}: {e}", param) from None
    except msgspec.DecodeError as e:
        raise RequestError(400, f"malformed JSON body: {e}") from None


def _checked(req: Any, chat: bool) -> Any:
    if chat and not req.messages:
        raise RequestError(400, "messages must not be empty", "messages")
    if req.kv_transfer_params is not None:
        try:
            req.kv_transfer_params.check()
        except InvalidKVTransferParams as e:
            raise RequestError(400, str(e), e.param) from None
    return req


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[str, int | None]:
    """(the field that set it, the limit): ``max_completion_tokens`` wins over ``max_tokens``."""
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def sampling_settings(req: CommonRequest, max_tokens: int,
                      max_tokens_param: str) -> dict[str, Any]:
    """The request's sampling settings, checked: ``SamplingParams``' keyword arguments."""
    if req.n != 1:
        raise RequestError(400, "only n=1 is supported", "n")
    if max_tokens < 1:
        raise RequestError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}",
                           max_tokens_param)
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise RequestError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise RequestError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "seed": req.seed, "ignore_eos": req.ignore_eos}
