"""How the proxy talks to engines: keep-alive shorter than theirs, and one retry of a
request that provably never reached the engine."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx

__all__ = ["CLIENT_KEEP_ALIVE", "never_reached", "send_retrying_once"]

log = logging.getLogger(__name__)

# Engines close idle keep-alive connections after 5 s (KVBRIDGE_KEEP_ALIVE_TIMEOUT): ours
# expire first, so the proxy does not pick a connection the engine is closing.
CLIENT_KEEP_ALIVE = 4.0

# Failures before a byte of the request left: safe to send again.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def never_reached(exc: httpx.HTTPError) -> bool:
    """The engine cannot have acted on the request: it was never sent, or the engine closed
    the (pooled, keep-alive) connection without a byte of answer. An engine that read a
    request answers it, even with a 500; closing unanswered is how an idle connection it
    is closing looks when our request crosses the close."""
    if isinstance(exc, _NOT_SENT):
        return True
    return isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc)


async def send_retrying_once(
    client: httpx.AsyncClient, request: httpx.Request, *, stream: bool = False,
    send: Callable[[httpx.Request], Awaitable[httpx.Response]] | None = None,
) -> httpx.Response:
    """``client.send`` (or ``send``), once more on a fresh connection if the first try
    never reached the engine (``never_reached``)."""
    if send is None:
        async def send(r: httpx.Request) -> httpx.Response:
            return await client.send(r, stream=stream)
    try:
        return await send(request)
    except httpx.HTTPError as exc:
        if not never_reached(exc):
            raise
        log.info(
            "%s %s never reached the engine (%r): sending it once more",
            request.method,
            request.url,
            exc,
        )
        return await send(request)
