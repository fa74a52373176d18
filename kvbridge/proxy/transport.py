"""The proxy's HTTP transport: httpx's client API on aiohttp's connections.

httpx is 1.4-1.7 ms slower than aiohttp per call (``kvbridge bench clients``), nearly all
of it in httpcore's pure-Python HTTP/1.1 (h11); aiohttp parses in C. The proxy's failover
rules, its streaming relay and every proxy test are written against httpx's API and
exceptions, so the swap is underneath them: ``AiohttpTransport`` is an
httpx transport, and aiohttp's failures are raised as the httpx exceptions they are
(``_TRANSLATION``, a table read top to bottom).

Sent once more, or never: a request the engine never got is sent again on a new connection
(``kvbridge.proxy.upstream.send_retrying_once``); one it may have started processing is
never repeated. The transport tells them apart by two facts it records per request:

* whether the connection was **reused** from the pool (aiohttp's ``on_connection_reuseconn``
  trace signal), and
* whether **any byte of answer** arrived before the failure: a status line and headers
  parsed (the body had begun), or part of them (aiohttp's parser hands the head it had
  begun to ``ServerDisconnectedError`` as a ``RawResponseMessage``; with not a byte it says
  only "Server disconnected"; a reset or a failed write is raised before anything was
  parsed).

An engine closes an idle keep-alive connection when its own timer says, and an engine that
read a request answers it, even with a 500. So on a reused connection, a close, a reset or
a failed write before any byte of answer is our request crossing that close: the engine
did not take it (``ClosedUnanswered``, sent once more). On a new connection the same
failure is not that race (the engine accepted the connection for this request) and may be
a crash mid-request: not repeated here (the flow's failover may send it to *another*
instance). Neither is a timeout (an engine maybe still at work) nor a failure after a byte
of answer. A reset that destroys a partly received head cannot be told from one that
arrived first; engines write a head in one piece, so that case is only a crash.
"""

from __future__ import annotations

import enum
import ssl
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
import certifi
import httpx

from kvbridge.errors import AnswerTooLarge, ClosedUnanswered
from kvbridge.limits import MAX_ANSWER_BYTES
from kvbridge.proxy.upstream import NEW_CONNECTION

__all__ = ["AiohttpTransport", "read_at_most", "too_large"]


def too_large(limit: int, request: httpx.Request) -> httpx.RemoteProtocolError:
    """The httpx error of an answer past ``limit``, raised from ``AnswerTooLarge``."""
    error = httpx.RemoteProtocolError(str(AnswerTooLarge(limit)), request=request)
    error.__cause__ = AnswerTooLarge(limit)
    return error


def _too_large(declared: str | int | None, limit: int) -> bool:
    try:
        return declared is not None and int(declared) > limit
    except ValueError:
        return False  # a malformed length: the parser's to refuse


async def read_at_most(response: httpx.Response, limit: int) -> bytes:
    """A streamed ``response``'s body, read no further than ``limit`` bytes: past it (or
    declared past it) ``too_large``'s error, and the caller's ``aclose`` closes the
    connection (a body not read to its end is never pooled)."""
    if _too_large(response.headers.get("content-length"), limit):
        raise too_large(limit, response.request)
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise too_large(limit, response.request)
        chunks.append(chunk)
    return b"".join(chunks)


def _ssl_arg(verify: ssl.SSLContext | bool) -> ssl.SSLContext | bool:
    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify:  # httpx's default: certifi's bundle
        return ssl.create_default_context(cafile=certifi.where())
    return False


class _When(enum.Enum):
    """How far the answer had come when the request failed."""

    UNANSWERED_REUSED = "not a byte of answer, on a reused connection"
    UNANSWERED_NEW = "not a byte of answer, on a new connection"
    HEAD = "part of the answer's head"
    BODY = "the head read, inside the body"


_ANY = frozenset(_When)
# The connection closed, reset, or failed under a write: whatever aiohttp calls it.
_CLOSED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
           aiohttp.ClientConnectionResetError, ConnectionError)

# aiohttp's (or asyncio's) failure, when, as httpx's, with this message ("{}": aiohttp's),
# raised from a ``ClosedUnanswered`` where the last column says so (the failover rules read
# it: ``never_reached``), else from aiohttp's own. The first row that matches wins:
# connector errors and timeouts are OSErrors too.
_TRANSLATION: tuple[tuple[tuple[type[BaseException], ...], frozenset[_When],
                          type[httpx.HTTPError], str, bool], ...] = (
    ((aiohttp.ConnectionTimeoutError,), _ANY, httpx.ConnectTimeout, "{}", False),
    ((aiohttp.ClientConnectorError,), _ANY, httpx.ConnectError, "{}", False),  # refused, TLS
    ((TimeoutError,), _ANY, httpx.ReadTimeout, "{}", False),  # SocketTimeoutError too
    (_CLOSED, frozenset({_When.UNANSWERED_REUSED}), httpx.RemoteProtocolError,
     "the engine closed a reused connection without answering ({})", True),
    (_CLOSED, frozenset({_When.UNANSWERED_NEW}), httpx.RemoteProtocolError,
     "Server disconnected without sending a response ({}).", False),
    (_CLOSED, frozenset({_When.HEAD}), httpx.RemoteProtocolError,
     "peer closed connection inside its answer's head ({})", False),
    ((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError), frozenset({_When.BODY}),
     httpx.RemoteProtocolError,
     "peer closed connection without sending complete message body ({})", False),
    ((BaseException,), _ANY, httpx.ReadError, "{}", False),  # a malformed head, broken body
)

_FAILURES = (aiohttp.ClientError, TimeoutError, OSError)


def _when(exc: BaseException, started: bool, reused: bool) -> _When:
    if started:
        return _When.BODY
    if isinstance(exc, aiohttp.ServerDisconnectedError) and not isinstance(exc.message, str):
        return _When.HEAD  # the parser had begun a head: bytes of answer arrived
    if isinstance(exc, aiohttp.ClientResponseError):
        return _When.HEAD  # a head that did not parse
    return _When.UNANSWERED_REUSED if reused else _When.UNANSWERED_NEW


def _translate(exc: BaseException, request: httpx.Request, when: _When) -> httpx.HTTPError:
    """aiohttp's (or asyncio's) failure as httpx's (``_TRANSLATION``), its cause set:
    raise it ``from`` its own ``__cause__``."""
    text = str(exc) or type(exc).__name__
    for kinds, whens, httpx_type, message, unanswered in _TRANSLATION:
        if isinstance(exc, kinds) and when in whens:
            error = httpx_type(message.format(text), request=request)
            cause: BaseException = exc
            if unanswered:
                cause = ClosedUnanswered(text)
                cause.__cause__ = exc
            error.__cause__ = cause
            return error
    raise AssertionError("the last row matches everything")  # pragma: no cover


async def _on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace,
                    params: aiohttp.TraceConnectionReuseconnParams) -> None:
    ctx.trace_request_ctx.reused = True


def _tracing() -> aiohttp.TraceConfig:
    config = aiohttp.TraceConfig()
    config.on_connection_reuseconn.append(_on_reuse)
    return config


class _Attempt:
    """One request's try: was its connection taken from the pool?"""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


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
            error = _translate(exc, self._request, _When.BODY)
            raise error from error.__cause__

    async def aclose(self) -> None:
        # Read to the end: the connection goes back to the pool; cut short: it is closed.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport on one ``aiohttp.ClientSession`` (no connection limit; idle
    connections kept ``keepalive`` seconds), opened on the first request, in its loop.
    A request whose extensions set ``NEW_CONNECTION`` goes on a connection of its own,
    closed after it (a second session, without a pool)."""

    def __init__(self, verify: ssl.SSLContext | bool = True, keepalive: float = 4.0):
        self._ssl = _ssl_arg(verify)
        self._keepalive = keepalive
        self._sessions: dict[bool, aiohttp.ClientSession] = {}

    def _open(self, new_connection: bool) -> aiohttp.ClientSession:
        session = self._sessions.get(new_connection)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                limit=0, ssl=self._ssl, force_close=new_connection,
                **({} if new_connection else {"keepalive_timeout": self._keepalive}))
            # Bodies as the engine sent them: httpx decodes by content-encoding itself.
            session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                            skip_auto_headers=("User-Agent",),
                                            timeout=aiohttp.ClientTimeout(total=None),
                                            trace_configs=[_tracing()])
            self._sessions[new_connection] = session
        return session

    async def _send(self, request: httpx.Request) -> aiohttp.ClientResponse:
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"),
                                        sock_read=t.get("read"))
        body = await request.aread()
        attempt = _Attempt()
        session = self._open(bool(request.extensions.get(NEW_CONNECTION)))
        try:
            return await session.request(
                request.method, str(request.url), data=body or None,
                headers=[(k.decode("latin-1"), v.decode("latin-1"))
                         for k, v in request.headers.raw],
                timeout=timeout, allow_redirects=False, compress=None,
                trace_request_ctx=attempt)
        except _FAILURES as exc:
            error = _translate(exc, request, _when(exc, False, attempt.reused))
            raise error from error.__cause__

    async def read(self, request: httpx.Request,
                   limit: int = MAX_ANSWER_BYTES) -> httpx.Response:
        """``request`` sent and its whole answer read, without httpx's client around it
        (auth, redirects, cookies: none of which the proxy uses): the prefill hop, where
        the client's own time is before the first token. An answer
        longer than ``limit`` bytes is ``too_large``'s error: read no further, its
        connection closed."""
        response = await self._send(request)
        try:
            if _too_large(response.content_length, limit):
                raise too_large(limit, request)
            chunks, size = [], 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit, request)
                chunks.append(chunk)
            content = b"".join(chunks)
        except _FAILURES as exc:
            response.close()
            error = _translate(exc, request, _When.BODY)
            raise error from error.__cause__
        except httpx.RemoteProtocolError:  # too large
            response.close()  # the rest unread: the connection is not reused
            raise
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
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()
