"""The client's request as the engines get it: the one-token prefill body and the headers
of both hops."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kvbridge.params import KVTransferParams

__all__ = ["CHAT", "COMPLETIONS", "engine_headers", "prefill_body"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def prefill_body(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The client's request, cut down to a one-token, non-streamed prefill."""
    out = dict(body)
    out["max_tokens"] = 1
    if endpoint == CHAT and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    # vLLM rejects stream_options without stream, and min_tokens above max_tokens.
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = KVTransferParams.for_prefill()
    return out


def engine_headers(request: Request, request_id: str) -> dict[str, str]:
    """Headers of both hops: our request id, the client's ``Authorization``, no compression."""
    headers = {
        "content-type": "application/json",
        "x-request-id": request_id,
        # Relayed bodies are passed through as bytes; keep them uncompressed.
        "accept-encoding": "identity",
    }
    auth = request.headers.get("authorization")
    if auth is not None:
        headers["authorization"] = auth
    return headers
