"""The ``http`` side channel's server: a dedicated Starlette app on uvicorn (httptools on
uvloop), on its own port in its own thread, never mounted on a user-facing API.

Routes: ``kvbridge.handshake.http.routes``. The protocol refuses request heads over
``MAX_REQUEST_BYTES`` (431) and bodies over it, declared or streamed (413,
``kvbridge.handshake.http.protocol``); the app refuses declared ones too. ``authz`` decides
who may fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Callable, Iterator

import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING, TLSConfig
from kvbridge.errors import error_body
from kvbridge.guard import ConnectionBudget, GuardedServer, guarded_protocol
from kvbridge.handshake.authz import Authorizer
from kvbridge.handshake.base import MAX_REQUEST_BYTES, HandshakeServer, MetadataStore, Observer
from kvbridge.handshake.http.fast_path import responder
from kvbridge.handshake.http.protocol import PEER_CERT, HeadLimitedHttpTools
from kvbridge.handshake.http.routes import MSGPACK, PATH, route_name
from kvbridge.net import grow_fd_table, listen_socket

__all__ = ["HttpHandshakeServer", "build_app"]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 503: "server_error"}


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
                                request.scope.get(PEER_CERT), "metadata")
        peer = None if request.client is None else f"{request.client.host}:{request.client.port}"
        raw = request.path_params.get("tp_rank")
        route = route_name(request.url.path)
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
            self.observer(route_name(scope["path"]), seen["status"], seen["bytes"])


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
                 authz: Authorizer | None = None, setting: str = SIDE_CHANNEL_PORT_SETTING,
                 sock: socket.socket | None = None):
        """``setting`` names what chose the port, for the error when it cannot be bound.
        ``sock``: a listening socket to serve instead (``host`` and ``port`` unused)."""
        self._authz = authz or Authorizer.token_only(token)
        self._app = build_app(store, token, observer, self._authz)
        # Handshakes and probes answered in the protocol, the rest by the app (http_fast).
        self._protocol = type("SideChannelHttpTools", (HeadLimitedHttpTools,),
                              {"responder": staticmethod(responder(store, self._authz,
                                                                   observer))})
        self._tls = tls or TLSConfig()
        # Bind now so the port is known (port 0 = ephemeral) and connections that
        # arrive before uvicorn runs wait in the backlog instead of being refused.
        self._sock = listen_socket(host, port, setting) if sock is None else sock
        # Side-channel peers reconnect rarely: keep their connections longer than the API's.
        self._budget = budget or ConnectionBudget.load(side_channel=True)
        # Above the guard's cap, so the guard evicts idle connections before uvicorn 503s.
        self._limit_concurrency = max(limit_concurrency, self._budget.max_connections + 64)
        self._server: _ThreadServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def running(self) -> bool:
        """Its server thread runs (started, not stopped)."""
        return self._thread is not None and self._thread.is_alive()

    def open_sockets(self) -> list[socket.socket]:
        """The sockets of the connections open now (what a test checks options on)."""
        server = self._server
        if server is None:
            return []
        return [c.transport.get_extra_info("socket") for c in list(server.server_state.connections)]

    def start(self) -> None:
        tls = self._tls
        config = uvicorn.Config(
            self._app, log_level="warning", access_log=False, lifespan="off",
            # httptools on uvloop: several times the requests per core of h11 on asyncio,
            # and TLS in C rather than asyncio's Python layer.
            http=guarded_protocol(self._protocol, self._budget, "side channel"),
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
        grow_fd_table(self._limit_concurrency)  # no fd-table growth (an RCU stall) under load
        self._thread = threading.Thread(target=lambda: uvloop.run(self._serve()),
                                        name="kvbridge-http-side-channel", daemon=True)
        self._thread.start()

    async def _serve(self) -> None:
        assert self._server is not None
        self._loop = asyncio.get_running_loop()
        await self._server.serve(sockets=[self._sock])

    def when_responsive(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None:  # not serving yet
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: no answer, as if stuck
            loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()
        self._authz.close()
