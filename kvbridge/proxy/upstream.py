"""How the proxy talks to engines: keep-alive shorter than theirs, and one retry of a
request that never reached the engine, on a new connection."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx

from kvbridge.errors import ClosedUnanswered

__all__ = ["CLIENT_KEEP_ALIVE", "NEW_CONNECTION", "never_reached", "send_retrying_once"]

log = logging.getLogger(__name__)

# Engines close idle keep-alive connections after 5 s (KVBRIDGE_KEEP_ALIVE_TIMEOUT): ours
# expire first, so the proxy does not pick a connection the engine is closing.
CLIENT_KEEP_ALIVE = 4.0

# A request extension: send it on a connection of its own, not one from the pool.
NEW_CONNECTION = "kvbridge.new_connection"

# Failures before a byte of the request left: safe to send again.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def never_reached(exc: httpx.HTTPError) -> bool:
    """The engine cannot have acted on the request: it was never sent, or the engine closed
    the reused keep-alive connection without a byte of answer (an error raised from
    ``ClosedUnanswered``: kvbridge.proxy.transport says how it tells that from an
    engine that may have started on the request). An engine that read a request answers
    it, even with a 500; closing unanswered is how an idle connection it is closing looks
    when our request crosses the close."""
    return isinstance(exc, _NOT_SENT) or isinstance(exc.__cause__, ClosedUnanswered)


async def send_retrying_once(
    client: httpx.AsyncClient, request: httpx.Request, *, stream: bool = False,
    send: Callable[[httpx.Request], Awaitable[httpx.Response]] | None = None,
) -> httpx.Response:
    """``client.send`` (or ``send``), once more on a new connection if the first try never
    reached the engine (``never_reached``): not one from the pool, which the engine may be
    closing too."""
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
        request.extensions = {**request.extensions, NEW_CONNECTION: True}
        return await send(request)
