"""The proxy's HTTP transport: httpx's client API on aiohttp's connections.

``kvbridge bench clients`` (BENCHMARKS.md §9) measured httpx 1.4-1.7 ms slower than aiohttp
per call, nearly all of it in httpcore's pure-Python HTTP/1.1 (h11); aiohttp parses in C.
The proxy's failover rules, its streaming relay and every proxy test are written against
httpx's API and exceptions, so the swap is underneath them: ``AiohttpTransport`` is an
httpx transport, and aiohttp's failures are raised as the httpx exceptions they are
(``never_reached`` in kvbridge.server.upstream reads them as before):

=========================================  =============================================
aiohttp                                    httpx
=========================================  =============================================
``ConnectionTimeoutError``                 ``ConnectTimeout``
``ClientConnectorError`` (refused, DNS)    ``ConnectError``
``ServerDisconnectedError`` before a byte  ``RemoteProtocolError`` "Server disconnected
                                           without sending a response."
``SocketTimeoutError``, a timeout          ``ReadTimeout``
a broken body, any other ``ClientError``   ``RemoteProtocolError`` / ``ReadError``
=========================================  =============================================
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import aiohttp
import certifi
import httpx

__all__ = ["AiohttpTransport"]


def _ssl_arg(verify: ssl.SSLContext | bool) -> ssl.SSLContext | bool:
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify:  # httpx's default: certifi's bundle
        return ssl.create_default_context(cafile=certifi.where())
    return False


def _translate(exc: BaseException, request: httpx.Request, started: bool) -> httpx.HTTPError:
    """aiohttp's (or asyncio's) failure as httpx's; ``started``: the response had begun."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(text, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(text, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError) and not started:
        return httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                         request=request)
    if isinstance(exc, aiohttp.SocketTimeoutError | asyncio.TimeoutError | TimeoutError):
        return httpx.ReadTimeout(text, request=request)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(
            f"peer closed connection without sending complete message body ({text})",
            request=request)
    return httpx.ReadError(text, request=request)


_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, OSError)


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body, as httpx reads a stream."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request):
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except _FAILURES as exc:
            raise _translate(exc, self._request, started=True) from exc

    async def aclose(self) -> None:
        # Read to the end: the connection goes back to the pool; cut short: it is closed.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport on one ``aiohttp.ClientSession`` (no connection limit; idle
    connections kept ``keepalive`` seconds), opened on the first request, in its loop."""

    def __init__(self, verify: ssl.SSLContext | bool = True, keepalive: float = 4.0):
        self._ssl = _ssl_arg(verify)
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive,
                                             ssl=self._ssl)
            # Bodies as the engine sent them: httpx decodes by content-encoding itself.
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                                  skip_auto_headers=("User-Agent",),
                                                  timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def _send(self, request: httpx.Request) -> aiohttp.ClientResponse:
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"),
                                        sock_read=t.get("read"))
        body = await request.aread()
        try:
            return await self._open().request(
                request.method, str(request.url), data=body or None,
                headers=[(k.decode("latin-1"), v.decode("latin-1"))
                         for k, v in request.headers.raw],
                timeout=timeout, allow_redirects=False, compress=None)
        except _FAILURES as exc:
            raise _translate(exc, request, started=False) from exc

    async def read(self, request: httpx.Request) -> httpx.Response:
        """``request`` sent and its whole answer read, without httpx's client around it
        (auth, redirects, cookies: none of which the proxy uses): the prefill hop, where
        the client's own time is before the first token (BENCHMARKS.md §9)."""
        response = await self._send(request)
        try:
            content = await response.read()
        except _FAILURES as exc:
            raise _translate(exc, request, started=True) from exc
        finally:
            response.release()
        return httpx.Response(response.status, headers=list(response.raw_headers),
                              content=content, request=request,
                              extensions={"http_version": b"HTTP/1.1"})

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._send(request)
        return httpx.Response(
            response.status, headers=list(response.raw_headers),
            stream=_Body(response, request),
            extensions={"http_version": b"HTTP/1.1",
                        "reason_phrase": (response.reason or "").encode("latin-1")})

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
