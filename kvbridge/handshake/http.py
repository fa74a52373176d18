"""The ``http`` method: a dedicated side-channel server (Starlette on uvicorn) and a keep-alive client on
``http.client``.

The server is its own ASGI app on its own port, never mounted on a user-facing
API. Routes:

* ``GET /v1/kv/handshake``            every rank's metadata (msgpack envelope)
* ``GET /v1/kv/handshake/{tp_rank}``  one rank's metadata
* ``GET /healthz``                    liveness, no token, no metadata
* ``GET /readyz``                     200 once every rank's metadata is in, else 503

``Accept: application/json`` on the handshake routes gives a JSON view.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import json
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbridge.config import TLSConfig
from kvbridge.errors import (
    HandshakeError,
    HandshakeTimeout,
    RetryableHandshakeError,
    WireFormatError,
    error_body,
)
from kvbridge.guard import ConnectionBudget, GuardedServer, guarded_protocol
from kvbridge.handshake._protocol import PEER_CERT, HeadLimitedHttpTools
from kvbridge.handshake.authz import Authorizer, TokenSet
from kvbridge.handshake.base import (
    MAX_REQUEST_BYTES,
    HandshakeClient,
    HandshakeServer,
    MetadataStore,
    Observer,
    Reply,
)

log = logging.getLogger(__name__)

MSGPACK = "application/vnd.msgpack"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "server_error"}
PATH = "/v1/kv/handshake"


def build_app(store: MetadataStore, token: str | None,
              observer: Observer | None = None, authz: Authorizer | None = None) -> ASGIApp:
    """``authz`` (named tokens, certificate allow-list, audit log) decides who may fetch;
    without it, ``token`` alone does."""
    if authz is None:
        authz = Authorizer.token_only(token)

    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse(error_body(message, _ERROR_TYPES.get(status, "server_error")),
                            status_code=status)

    async def handshake(request: Request) -> Response:
        decision = authz.decide(request.headers.get("authorization"),
                                request.scope.get(PEER_CERT))
        peer = None if request.client is None else f"{request.client.host}:{request.client.port}"
        raw = request.path_params.get("tp_rank")
        route = _route(request.url.path)
        if not decision.ok:
            authz.record(decision, peer, route, None)
            return _error(decision.status, decision.message)
        if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 6):
            authz.record(decision, peer, route, None, "refused 404")
            return _error(404, f"tp_rank must be a non-negative integer, got {raw[:16]!r}")
        tp_rank = None if raw is None else int(raw)
        reply = store.reply(tp_rank)
        authz.record(decision, peer, route, tp_rank,
                     "ok" if reply.status == 200 else f"refused {reply.status}")
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


class _ThreadServer(GuardedServer):
    # Signals belong to the process's main thread, not to the side channel.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpHandshakeServer(HandshakeServer):
    method = "http"

    def __init__(self, store: MetadataStore, host: str, port: int, *, token: str | None = None,
                 tls: TLSConfig | None = None, limit_concurrency: int = 2048,
                 observer: Observer | None = None, budget: ConnectionBudget | None = None,
                 authz: Authorizer | None = None):
        self._app = build_app(store, token, observer, authz)
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
        # Side-channel peers reconnect rarely: keep their connections longer than the API's.
        self._budget = budget or ConnectionBudget.from_env(keep_alive_timeout=30.0)
        # Above the guard's cap, so the guard evicts idle connections before uvicorn 503s.
        self._limit_concurrency = max(limit_concurrency, self._budget.max_connections + 64)
        self._server: _ThreadServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def start(self) -> None:
        tls = self._tls
        config = uvicorn.Config(
            self._app, log_level="warning", access_log=False, lifespan="off",
            # httptools on uvloop: several times the requests per core of h11 on asyncio,
            # and TLS in C rather than asyncio's Python layer (kvbridge bench sidechannel,
            # handshake; BENCHMARKS.md).
            http=guarded_protocol(HeadLimitedHttpTools, self._budget, "side channel"),
            ws="none", backlog=2048, timeout_keep_alive=self._budget.keep_alive_timeout,
            limit_concurrency=self._limit_concurrency,
            ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile, ssl_ca_certs=tls.ca_certs,
            ssl_cert_reqs=tls.cert_reqs,
            # Idle TLS keep-alive peers never answer our close_notify: without a bound,
            # stop() waits for them (asyncio's 30 s TLS shutdown timeout).
            timeout_graceful_shutdown=1)
        if tls.enabled:
            config.load()
            config.ssl.minimum_version = ssl.TLSVersion.TLSv1_2  # uvicorn has no setting
        self._server = _ThreadServer(config)
        self._thread = threading.Thread(target=lambda: uvloop.run(
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
    """HTTP/1.1 over the standard library's ``http.client``: one keep-alive connection per
    peer (a small pool of idle ones when several threads fetch at once), TLS contexts and
    sessions shared by every client with the same settings, so a new client to a known
    peer resumes the TLS session instead of a full handshake. Never follows redirects."""

    method = "http"

    def __init__(self, timeout: float, expected, token: str | None = None,
                 max_message_bytes: int | None = None, tls: TLSConfig | None = None,
                 scheme: str | None = None, token_file: str | None = None):
        """``token_file``: where ``token`` came from; read again when it changes, so the
        token sent follows a rotation without a new client."""
        kwargs = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        super().__init__(timeout, expected, token, **kwargs)
        tls = tls or TLSConfig()
        # https whenever we have a CA to verify the server against (or our own cert).
        self.scheme = scheme or ("https" if (tls.ca_certs or tls.certfile) else "http")
        # Plain http needs no SSL context (building the default one costs ~90 ms).
        self._tls = _tls_state(tls) if self.scheme == "https" else None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._headers = {"accept": MSGPACK}
        if self.token:
            self._headers["authorization"] = f"Bearer {self.token}"
        self._token_file = None if not (token_file and self.token) else TokenSet(
            {"token": self.token}, path=token_file)

    def _request_headers(self) -> dict[str, str]:
        if self._token_file is None:
            return self._headers
        return {**self._headers, "authorization": f"Bearer {self._token_file.current()}"}

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        h = f"[{host}]" if ":" in host else host
        path = PATH + ("" if tp_rank is None else f"/{tp_rank}")
        url = f"{self.scheme}://{h}:{port}{path}"
        if deadline - time.monotonic() <= 0:
            raise HandshakeTimeout(f"http handshake with {url}: no time left")
        # One watchdog over the whole request: at the deadline it shuts the connection
        # under whatever read is blocked (trickled heads and bodies included).
        current: list[_Connection] = []
        watchdog = _WATCHDOG.arm(deadline, lambda: current and current[-1].cut())
        try:
            conn = self._take(host, port)
            reused = conn is not None
            while True:
                if conn is None:
                    conn = self._connect(host, port, deadline, current)
                current.append(conn)
                try:
                    status, body, keep = self._exchange(conn, path, url, deadline)
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError,
                        BrokenPipeError):
                    conn.close()
                    if not reused or time.monotonic() >= deadline:
                        raise
                    # The peer closed an idle keep-alive connection: once more, on a new one.
                    conn, reused = None, False
        except (http.client.HTTPException, OSError, ValueError, WireFormatError) as e:
            for c in current:
                c.close()
            if time.monotonic() >= deadline:  # cut by the watchdog: whatever broke, it's late
                raise HandshakeTimeout(f"http handshake with {url}: not complete within "
                                       f"{self.timeout:g}s") from None
            if isinstance(e, WireFormatError):
                raise
            raise self._translate(e, url) from None
        finally:
            watchdog.cancel()
        if time.monotonic() >= deadline:
            conn.close()
            raise HandshakeTimeout(f"{url}: reply not complete within {self.timeout:g}s")
        if keep:
            self._give(host, port, conn)
        else:
            conn.close()
        if status != 200:
            return Reply(status, error=_error_text(body))
        return Reply(200, body)

    def _take(self, host: str, port: int) -> _Connection | None:
        with self._lock:
            conns = self._idle.get((host, port))
            while conns:
                conn = conns.pop()
                if conn.usable():
                    return conn
                conn.close()
        return None

    def _give(self, host: str, port: int, conn: _Connection) -> None:
        with self._lock:
            conns = self._idle.setdefault((host, port), [])
            if len(conns) < _MAX_IDLE_PER_PEER:
                conns.append(conn)
                return
        conn.close()

    def _connect(self, host: str, port: int, deadline: float,
                 current: list[_Connection]) -> _Connection:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left to connect")
        try:
            sock = socket.create_connection((host.strip("[]"), port), timeout=left)
        except TimeoutError:
            raise
        except OSError as e:  # refused, unreachable, no such name (yet): the peer may be starting
            raise RetryableHandshakeError(f"{type(e).__name__}: {e}") from None
        conn = _Connection(host, port, sock)
        current.append(conn)  # the watchdog can cut the TLS handshake too
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            conn.wrap(self._tls)
        return conn

    def _exchange(self, conn: _Connection, path: str, url: str,
                  deadline: float) -> tuple[int, bytes, bool]:
        """Send the GET, read the capped reply: (status, body, connection reusable)."""
        conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        conn.http.request("GET", path, headers=self._request_headers())
        resp = conn.http.getresponse()
        body = self._read_capped(resp, url)
        conn.remember_session(self._tls)
        return resp.status, body, not resp.will_close

    def _translate(self, e: Exception, url: str) -> Exception:
        """A transport failure before the deadline, as the error a caller can act on."""
        if isinstance(e, ssl.SSLError | ssl.CertificateError):
            return HandshakeError(f"TLS with {url} failed: {e}")
        if isinstance(e, http.client.RemoteDisconnected | ConnectionResetError
                      | BrokenPipeError):
            hint = ("does it require a client certificate (mTLS)?" if self.scheme == "https"
                    else "is it a TLS server spoken to in plaintext?")
            return HandshakeError(f"{url} closed the connection without an answer ({e}); {hint}")
        if isinstance(e, http.client.HTTPException):  # it answered, but not in HTTP
            return WireFormatError(f"{url} answered something that is not HTTP: "
                                   f"{type(e).__name__}: {e}")
        if isinstance(e, TimeoutError):
            return HandshakeTimeout(f"http handshake with {url}: no answer within "
                                    f"{self.timeout:g}s")
        return HandshakeError(f"http handshake with {url}: {type(e).__name__}: {e}")

    def _read_capped(self, resp: http.client.HTTPResponse, url: str) -> bytes:
        """The body, at most ``max_message_bytes``; a body shorter than declared is an error."""
        limit = self.max_message_bytes
        declared = resp.getheader("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise WireFormatError(f"{url}: reply of {declared} bytes exceeds the limit of {limit}")
        chunks, size = [], 0
        while True:
            chunk = resp.read(min(65536, limit + 1 - size))
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise WireFormatError(f"{url}: reply exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        if resp.length:  # http.client returns short bodies silently when the peer closes
            raise WireFormatError(f"{url}: reply body ended {resp.length} bytes short")
        return b"".join(chunks)


# Idle keep-alive connections kept per peer and client (more only while threads overlap).
_MAX_IDLE_PER_PEER = 4
_MAX_SESSIONS = 1024


class _TlsState:
    """An SSL context and the TLS sessions it made, per peer, for resumption."""

    def __init__(self, context: ssl.SSLContext):
        self.context = context
        self.sessions: dict[tuple[str, int], ssl.SSLSession] = {}
        self.lock = threading.Lock()

    def session(self, host: str, port: int) -> ssl.SSLSession | None:
        with self.lock:
            return self.sessions.get((host, port))

    def remember(self, host: str, port: int, session: ssl.SSLSession) -> None:
        with self.lock:
            self.sessions.pop((host, port), None)
            self.sessions[(host, port)] = session
            while len(self.sessions) > _MAX_SESSIONS:
                self.sessions.pop(next(iter(self.sessions)))


_TLS_STATES: dict[tuple, _TlsState] = {}
_TLS_STATES_LOCK = threading.Lock()


def _tls_state(tls: TLSConfig) -> _TlsState:
    """One context per TLS setting (and per version of its files on disk), shared by all
    clients: a context is costly to build, and sessions resume only within one."""
    files = []
    for f in (tls.certfile, tls.keyfile, tls.ca_certs):
        try:
            files.append(os.stat(f).st_mtime_ns if f else None)
        except OSError:
            files.append(None)  # client_context() says what is wrong with it
    key = (tls, tuple(files))
    with _TLS_STATES_LOCK:
        state = _TLS_STATES.get(key)
    if state is None:
        state = _TlsState(tls.client_context())
        with _TLS_STATES_LOCK:
            state = _TLS_STATES.setdefault(key, state)
    return state


class _Connection:
    """One keep-alive connection: its socket (TLS-wrapped or not) and the http.client
    object that speaks HTTP/1.1 on it."""

    def __init__(self, host: str, port: int, sock: socket.socket):
        self.host, self.port, self.sock = host, port, sock
        self.http = http.client.HTTPConnection(host.strip("[]"), port)
        self.http.sock = sock
        self.resumed = False

    def wrap(self, tls: _TlsState) -> None:
        session = tls.session(self.host, self.port)
        self.sock = tls.context.wrap_socket(self.sock, server_hostname=self.host.strip("[]"),
                                            session=session)
        self.http.sock = self.sock
        self.resumed = self.sock.session_reused

    def remember_session(self, tls: _TlsState | None) -> None:
        # TLS 1.3 tickets arrive after the handshake: the session is known once we read.
        if tls is not None and not self.resumed:
            session = getattr(self.sock, "session", None)
            if session is not None:
                tls.remember(self.host, self.port, session)
                self.resumed = True  # one ticket per connection is enough

    def usable(self) -> bool:
        """Still open: an idle connection the peer closed reads as ready (EOF)."""
        try:
            if self.sock.fileno() < 0:
                return False
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def cut(self) -> None:
        """Unblock a read in progress (closing alone does not: the reader sits in recv).
        ``socket.shutdown`` of the base class: SSLSocket's own would drop its TLS state
        under the reading thread."""
        with contextlib.suppress(OSError, ValueError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.http.close()
        with contextlib.suppress(OSError):
            self.sock.close()


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


def _error_text(body: bytes) -> str:
    text = body[:300].decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)
