"""The decode's streamed answer relayed to the client as it arrives."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["UpstreamResponse"]

log = logging.getLogger(__name__)

# Per-hop headers, and ones we set ourselves, are not relayed from the decode to the client.
DROP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
        "x-request-id",
    }
)


class UpstreamResponse(StreamingResponse):
    """Relays an engine's streamed response as it arrives and always closes it afterwards,
    also when the client goes away mid-stream (else the engine keeps generating)."""

    def __init__(self, upstream: httpx.Response, url: str, request_id: str,
                 first: bytes | None = None, chunks: AsyncIterator[bytes] | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_HEADERS}
        headers["x-request-id"] = request_id
        super().__init__(
            self._relay(upstream, url, first, chunks), status_code=upstream.status_code,
            headers=headers
        )
        self._upstream = upstream
        self._on_close = on_close

    @staticmethod
    async def _relay(upstream: httpx.Response, url: str, first: bytes | None,
                     chunks: AsyncIterator[bytes] | None) -> AsyncIterator[bytes]:
        try:
            if first:  # read ahead to know the decode was alive at its first token
                yield first
            async for chunk in chunks or upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            # The status is already sent; aborting the connection tells the client it's cut.
            log.error("decode %s failed mid-response: %r", url, exc)
            raise

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
            if self._on_close is not None:
                self._on_close()
