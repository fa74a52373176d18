"""The ``http`` method: a dedicated side-channel server (Starlette on uvicorn) and an httpx client.

The server is its own ASGI app on its own port, never mounted on a user-facing
API. Routes:

* ``GET /v1/kv/handshake``            every rank's metadata (msgpack envelope)
* ``GET /v1/kv/handshake/{tp_rank}``  one rank's metadata
* ``GET /healthz``                    liveness, no token, no metadata
* ``GET /readyz``                     200 once every rank's metadata is in, else 503

``Accept: application/json`` on the handshake routes gives a JSON view.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbridge.config import TLSConfig
from kvbridge.errors import HandshakeError, HandshakeTimeout, WireFormatError, error_body
from kvbridge.handshake.base import (
    MAX_REQUEST_BYTES,
    HandshakeClient,
    HandshakeServer,
    MetadataStore,
    Observer,
    Reply,
    _Retry,
    token_ok,
)

log = logging.getLogger(__name__)

MSGPACK = "application/vnd.msgpack"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "server_error"}
PATH = "/v1/kv/handshake"


def build_app(store: MetadataStore, token: str | None,
              observer: Observer | None = None) -> ASGIApp:
    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse(error_body(message, _ERROR_TYPES.get(status, "server_error")),
                            status_code=status)

    async def handshake(request: Request) -> Response:
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if not token_ok(token, given if scheme.lower() == "bearer" else None):
            # Same answer for a missing and a wrong token: nothing to probe.
            return _error(401, "missing or invalid bearer token")
        raw = request.path_params.get("tp_rank")
        if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 6):
            return _error(404, f"tp_rank must be a non-negative integer, got {raw[:16]!r}")
        tp_rank = None if raw is None else int(raw)
        reply = store.reply(tp_rank)
        if reply.status != 200:
            return _error(reply.status, reply.error)
        if "application/json" in request.headers.get("accept", ""):
            return JSONResponse(store.json_view(tp_rank))
        return Response(reply.body, media_type=MSGPACK)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(request: Request) -> Response:
        if store.ready:
            return PlainTextResponse("ready")
        return PlainTextResponse("not ready", status_code=503)

    app = Starlette(routes=[
        Route(PATH, handshake, methods=["GET"]),
        Route(PATH + "/{tp_rank}", handshake, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ])
    app.router.redirect_slashes = False  # a side channel answers or refuses; no redirects
    limited = _BodyLimit(app, MAX_REQUEST_BYTES)
    return limited if observer is None else _Observe(limited, observer)


def _route(path: str) -> str:
    if path == PATH:
        return "handshake_all"
    if path.startswith(PATH + "/"):
        return "handshake_rank"
    return path.strip("/") if path in ("/healthz", "/readyz") else "other"


class _Observe:
    """Tell the observer each request's route, status and body size."""

    def __init__(self, app: ASGIApp, observer: Observer):
        self.app = app
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = {"status": 500, "bytes": 0}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.observer(_route(scope["path"]), seen["status"], seen["bytes"])


class _BodyLimit:
    """Refuse request bodies over ``limit`` bytes (413) before the app reads them."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                    await JSONResponse(error_body("request body too large"),
                                       status_code=413)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class _ThreadServer(uvicorn.Server):
    # Signals belong to the process's main thread, not to the side channel.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpHandshakeServer(HandshakeServer):
    method = "http"

    def __init__(self, store: MetadataStore, host: str, port: int, *, token: str | None = None,
                 tls: TLSConfig | None = None, limit_concurrency: int = 2048,
                 observer: Observer | None = None):
        self._app = build_app(store, token, observer)
        self._tls = tls or TLSConfig()
        # Bind now so the port is known (port 0 = ephemeral) and connections that
        # arrive before uvicorn runs wait in the backlog instead of being refused.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say TCP, and with
        # Nagle on, every keep-alive reply waits ~40 ms for the peer's delayed ACK.
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), port))
        self._sock.listen(2048)
        self._limit_concurrency = limit_concurrency
        self._server: _ThreadServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def start(self) -> None:
        tls = self._tls
        config = uvicorn.Config(
            self._app, log_level="warning", access_log=False, lifespan="off",
            http="h11", loop="asyncio", backlog=2048, timeout_keep_alive=30,
            limit_concurrency=self._limit_concurrency,
            h11_max_incomplete_event_size=MAX_REQUEST_BYTES,
            ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile, ssl_ca_certs=tls.ca_certs,
            ssl_cert_reqs=tls.cert_reqs,
            # Idle TLS keep-alive peers never answer our close_notify: without a bound,
            # stop() waits for them (asyncio's 30 s TLS shutdown timeout).
            timeout_graceful_shutdown=1)
        if tls.enabled:
            config.load()
            config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2  # uvicorn has no setting
        self._server = _ThreadServer(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(
            self._server.serve(sockets=[self._sock])), name="kvbridge-http-side-channel",
            daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()


class HttpHandshakeClient(HandshakeClient):
    method = "http"

    def __init__(self, timeout: float, expected, token: str | None = None,
                 max_message_bytes: int | None = None, tls: TLSConfig | None = None,
                 scheme: str | None = None):
        kwargs = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        super().__init__(timeout, expected, token, **kwargs)
        tls = tls or TLSConfig()
        # https whenever we have a CA to verify the server against (or our own cert).
        self.scheme = scheme or ("https" if (tls.ca_certs or tls.certfile) else "http")
        # Plain http needs no SSL context (building the default one costs ~90 ms).
        verify = tls.client_context() if self.scheme == "https" else False
        self._client = httpx.Client(verify=verify, trust_env=False,
                                    limits=httpx.Limits(max_connections=64))

    def close(self) -> None:
        self._client.close()

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        h = f"[{host}]" if ":" in host else host
        url = f"{self.scheme}://{h}:{port}{PATH}" + ("" if tp_rank is None else f"/{tp_rank}")
        headers = {"accept": MSGPACK}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeout(f"http handshake with {url}: no time left")
        # One watchdog over the whole request: at the deadline it shuts the connection
        # under whatever read is blocked (headers trickled in count too). A new
        # connection is known from the trace hook, a reused one from the response.
        conn: dict[str, object] = {}
        watchdog = _WATCHDOG.arm(deadline, lambda: _cut(conn.get("stream")))
        try:
            with self._client.stream("GET", url, headers=headers, timeout=httpx.Timeout(left),
                                     extensions={"trace": _tracer(conn)}) as resp:
                conn.setdefault("stream", resp.extensions.get("network_stream"))
                body = self._read_capped(resp, url)
        except (httpx.HTTPError, httpx.StreamError, OSError, RuntimeError) as e:
            if time.monotonic() >= deadline:
                raise HandshakeTimeout(f"http handshake with {url}: not complete within "
                                       f"{self.timeout:g}s") from None
            raise self._translate(e, url) from None
        finally:
            watchdog.cancel()
        if time.monotonic() >= deadline:
            raise HandshakeTimeout(f"{url}: reply not complete within {self.timeout:g}s")
        if resp.status_code != 200:
            return Reply(resp.status_code, error=_error_text(body))
        return Reply(200, body)

    def _translate(self, e: Exception, url: str) -> Exception:
        """A transport failure before the deadline, as the error a caller can act on."""
        if isinstance(e, httpx.ConnectError):
            if _is_tls_error(e):
                return HandshakeError(f"TLS with {url} failed: {e}")
            return _Retry(f"{type(e).__name__}: {e}")  # refused: the peer may be starting
        if isinstance(e, httpx.RemoteProtocolError):
            if "without sending a response" not in str(e):  # it answered, but not in HTTP
                return WireFormatError(f"{url} answered something that is not HTTP: {e}")
            hint = ("does it require a client certificate (mTLS)?" if self.scheme == "https"
                    else "is it a TLS server spoken to in plaintext?")
            return HandshakeError(f"{url} closed the connection without an answer ({e}); {hint}")
        if isinstance(e, httpx.TimeoutException):
            return HandshakeTimeout(f"http handshake with {url}: no answer within "
                                    f"{self.timeout:g}s")
        return HandshakeError(f"http handshake with {url}: {type(e).__name__}: {e}")

    def _read_capped(self, resp: httpx.Response, url: str) -> bytes:
        """The body, at most ``max_message_bytes``."""
        limit = self.max_message_bytes
        declared = resp.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise WireFormatError(f"{url}: reply of {declared} bytes exceeds the limit of {limit}")
        chunks, size = [], 0
        for chunk in resp.iter_bytes():
            size += len(chunk)
            if size > limit:
                raise WireFormatError(f"{url}: reply exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


class _Watchdog:
    """Calls ``action`` at ``deadline`` unless cancelled first: one daemon thread for
    every pending deadline of the process (started on first use)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._live: set[int] = set()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, action: Callable[[], object]) -> _Armed:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvbridge-http-watchdog")
                self._thread.start()
            seq = next(self._seq)
            heapq.heappush(self._heap, (deadline, seq, action))
            self._live.add(seq)
            if self._heap[0][1] == seq:
                self._cond.notify()
        return _Armed(self, seq)

    def _cancel(self, seq: int) -> None:
        with self._cond:
            self._live.discard(seq)
            while self._heap and self._heap[0][1] not in self._live:
                heapq.heappop(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, seq, action = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(seq)
            try:
                action()
            except Exception:  # closing a response must not end the watchdog
                log.debug("watchdog action failed", exc_info=True)


class _Armed:
    def __init__(self, watchdog: _Watchdog, seq: int):
        self._watchdog, self._seq = watchdog, seq

    def cancel(self) -> None:
        self._watchdog._cancel(self._seq)


_WATCHDOG = _Watchdog()


def _tracer(conn: dict[str, object]) -> Callable[[str, dict], None]:
    def trace(event: str, info: dict) -> None:
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            conn["stream"] = info.get("return_value")
    return trace


def _cut(stream: object) -> None:
    """Unblock a read in progress on a connection (closing the response alone does not:
    the reading thread sits in recv)."""
    get = getattr(stream, "get_extra_info", None)
    sock = get("socket") if get is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _is_tls_error(e: Exception) -> bool:
    cause = e
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return True
        cause = cause.__cause__ or cause.__context__
    return "SSL" in str(e) or "certificate" in str(e).lower()


def _error_text(body: bytes) -> str:
    text = body[:300].decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)
