"""The client's request as the engines get it: the one-token prefill body, the headers of
both hops, and the check that those headers can be sent on at all."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbridge.params import KVTransferParams
from kvbridge.proxy.engine_client import proxy_error

__all__ = ["CHAT", "COMPLETIONS", "PassedOnHeaders", "engine_headers", "prefill_body"]

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


# The client's headers the proxy sends on to the engines (``engine_headers``, /v1/models).
PASSED_ON = {b"authorization": "Authorization"}


class PassedOnHeaders:
    """Refuses (400) a request whose headers the proxy passes on to the engines hold a byte
    outside ASCII. HTTP/1.1 lets a header value carry Latin-1 bytes, but the proxy's
    clients to the engines send ASCII only: the request failed there, a 500 with a
    traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name in PASSED_ON and not value.isascii():
                    response = proxy_error(
                        400, f"invalid {PASSED_ON[name]} header: only ASCII characters are "
                        "accepted", "invalid_request_error", PASSED_ON[name].lower())
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
