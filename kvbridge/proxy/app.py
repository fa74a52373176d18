"""The proxy app: its parts wired together, its lifespan, the user routes, and the runner."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvbridge import supervised
from kvbridge.guard import ConnectionBudget, GuardedServer, guarded_config
from kvbridge.limits import MAX_ANSWER_BYTES
from kvbridge.proxy.admin import AdminRoutes
from kvbridge.proxy.background_tasks import TaskSet
from kvbridge.proxy.engine_client import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_TIMEOUT,
    HEALTH_TIMEOUT,
    EngineClient,
    check_urls,
    proxy_error,
    ssl_context,
    transport_error,
)
from kvbridge.proxy.flow import Flow
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.prewarm import Prewarmer
from kvbridge.proxy.release import Releaser
from kvbridge.proxy.rewrite import CHAT, COMPLETIONS, PassedOnHeaders
from kvbridge.proxy.routing import Router

if TYPE_CHECKING:  # the registry needs the ``fleet`` extra: imported only when used
    from kvbridge.proxy.membership import Membership
    from kvbridge.registry.etcd_client import EtcdEndpoint

__all__ = ["Proxy", "build_proxy_app", "run_proxy"]


class Proxy:
    """One proxy's state: the router, the engine client, the counters, and the parts that
    use them (``app.state.proxy``)."""

    def __init__(self, router: Router, engines: EngineClient, *, prewarm: bool = True,
                 kv_token: str | None = None, prefill_timeout: float | None = None,
                 membership: Membership | None = None,
                 first_token_from: str = "prefill") -> None:
        self.router = router
        self.engines = engines
        self.prewarm = prewarm
        self.membership = membership
        self.metrics = ProxyMetrics()
        self.tasks = TaskSet()
        self.releaser = Releaser(engines, self.metrics, self.tasks, kv_token)
        self.prewarmer = Prewarmer(router, engines, self.metrics, self.tasks, kv_token)
        self.flow = Flow(router, engines, self.metrics, self.releaser, prefill_timeout,
                         first_token_from)
        self.admin = AdminRoutes(router, engines, self.metrics, self.prewarmer, membership)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engines.open()
        task = None
        if self.prewarm:
            self.prewarmer.loop = asyncio.get_running_loop()
            task = asyncio.create_task(self.prewarmer.prewarm_all())
        if self.membership is not None:
            self.membership.start()
            # Serve with the registry's view when it answers soon; else start empty.
            await asyncio.to_thread(self.membership.synced.wait, HEALTH_TIMEOUT)
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            self.prewarmer.loop = None
            if self.membership is not None:
                await asyncio.to_thread(self.membership.close)
            await self.tasks.wait(HEALTH_TIMEOUT)  # releases under way: let them reach the prefills
            await self.engines.aclose()

    async def models(self, request: Request) -> Response:
        decodes = self.router.urls("decode")
        if not decodes:
            return proxy_error(503, "no decode instance is known yet", "service_unavailable")
        url = decodes[0]
        headers = {"accept-encoding": "identity"}  # relayed as read, read as sent
        if (auth := request.headers.get("authorization")) is not None:
            headers["authorization"] = auth
        client = self.engines.http
        try:
            resp = await client.send(client.build_request("GET", url + "/v1/models",
                                                          headers=headers), stream=True)
            try:
                content = await self.engines.read_body(resp)
            finally:
                await resp.aclose()
        except httpx.HTTPError as exc:
            return transport_error("decode", url, exc)
        return Response(
            content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    async def health(self, request: Request) -> Response:
        if stopped := supervised.down():
            return JSONResponse({"status": "degraded", "background_down": stopped},
                                status_code=503)
        return JSONResponse({"status": "ok"})


def build_proxy_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    ca_certs: str | None = None,
    client_cert: tuple[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    prewarm: bool = True,
    kv_token: str | None = None,
    registry: EtcdEndpoint | None = None,
    routing: str = "least-outstanding",
    prefill_timeout: float | None = None,
    admin_token: str | None = None,
    admin_routes: str | None = None,
    metrics_route: str | None = None,
    first_token_from: str = "prefill",
    max_answer_bytes: int = MAX_ANSWER_BYTES,
) -> Starlette:
    """The P/D proxy as a Starlette app.

    Engines come from the static lists and, with ``registry``, from watching etcd;
    ``routing`` picks among them (see ``kvbridge.proxy.routing``).

    ``ca_certs`` verifies https engines (default: certifi's bundle); ``client_cert`` is a
    (certfile, keyfile) pair presented for mTLS. ``timeout`` bounds, in all, the prefill
    hop and a decode's answer up to its first byte, and each read/write towards an engine;
    ``connect_timeout`` each connection attempt. With ``prewarm`` the proxy tells
    every decode, at start-up, to handshake with every prefill (``kv_token``: the
    side-channel token the decodes require for that). ``prefill_timeout`` bounds the
    prefill hop alone, in all (default: ``timeout``): past it another prefill is tried, or
    the client gets a 504 saying so.

    The admin routes (``/v1/fleet``, ``/healthz/backends``, ``GET /v1/kv/prewarm``) are
    ``admin_routes``: ``"off"`` (not served), ``"token"`` (``Authorization: Bearer
    <admin_token>``) or ``"open"``; default ``"token"`` with an ``admin_token``, else
    ``"off"``. ``/metrics`` is ``metrics_route``, the same choices (default: as the admin
    routes).

    ``first_token_from``: ``"prefill"`` streams a streamed answer's first token as soon as
    the prefill sampled it, and the decode continues after it (``kvbridge.proxy.
    first_token``); ``"decode"``: every token from the decode (vLLM's two-hop protocol).

    ``max_answer_bytes``: the most of an engine's answer read whole (a prefill's, a decode's
    error body); past it a 502 naming the limit, the connection closed.
    """
    router = Router(routing)
    router.add_static("prefill", check_urls("prefill", prefill_urls, registry is not None))
    router.add_static("decode", check_urls("decode", decode_urls, registry is not None))
    verify = ssl_context(ca_certs, client_cert)
    membership = None
    if registry is not None:
        from kvbridge.proxy.membership import Membership
        from kvbridge.registry.etcd_client import EtcdRegistry

        membership = Membership(EtcdRegistry(registry), router, verify=verify)
    proxy = Proxy(router, EngineClient(verify, httpx.Timeout(timeout, connect=connect_timeout),
                                       max_answer_bytes),
                  prewarm=prewarm, kv_token=kv_token, prefill_timeout=prefill_timeout,
                  membership=membership, first_token_from=first_token_from)
    if membership is not None:
        router.on_added = proxy.prewarmer.backend_added
    routes = [
        Route(COMPLETIONS, proxy.flow.endpoint(COMPLETIONS), methods=["POST"]),
        Route(CHAT, proxy.flow.endpoint(CHAT), methods=["POST"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
        *proxy.admin.routes(admin_routes, metrics_route, admin_token),
    ]
    app = Starlette(routes=routes, lifespan=proxy.lifespan,
                    middleware=[Middleware(PassedOnHeaders)])
    app.state.proxy = proxy
    return app


def run_proxy(
    prefill_urls: list[str],
    decode_urls: list[str],
    *,
    host: str = "127.0.0.1",  # kvbridge.settings.DEFAULT_HOST
    port: int = 8000,
    ca_certs: str | None = None,
    client_cert: tuple[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    log_level: str = "info",
    prewarm: bool = True,
    kv_token: str | None = None,
    registry: EtcdEndpoint | None = None,
    routing: str = "least-outstanding",
    prefill_timeout: float | None = None,
    admin_token: str | None = None,
    admin_routes: str | None = None,
    metrics_route: str | None = None,
    budget: ConnectionBudget | None = None,
    first_token_from: str = "prefill",
) -> None:
    """Serve the proxy with uvicorn until interrupted.

    ``ssl_certfile``/``ssl_keyfile`` make the proxy itself serve https to its clients;
    ``budget``: its connections' (default: from the environment).
    """
    app = build_proxy_app(
        prefill_urls,
        decode_urls,
        ca_certs=ca_certs,
        client_cert=client_cert,
        timeout=timeout,
        connect_timeout=connect_timeout,
        prewarm=prewarm,
        kv_token=kv_token,
        registry=registry,
        routing=routing,
        prefill_timeout=prefill_timeout,
        admin_token=admin_token,
        admin_routes=admin_routes,
        metrics_route=metrics_route,
        first_token_from=first_token_from,
    )
    scheme = "https" if ssl_certfile else "http"
    print(
        f"kvbridge proxy on {scheme}://{host}:{port} "
        f"prefill={','.join(prefill_urls)} decode={','.join(decode_urls)}"
        + (f" registry={registry.url} routing={routing}" if registry else ""),
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        **guarded_config("proxy", budget),
    )
    server = GuardedServer(config)
    server.run()
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: the server could not start
