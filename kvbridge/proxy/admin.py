"""The proxy's operator routes: ``/v1/fleet``, ``/healthz/backends``, ``GET /v1/kv/prewarm``
and ``/metrics``; each group off, behind the admin token, or open (off by default)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvbridge import supervised
from kvbridge.errors import ConfigError
from kvbridge.proxy.engine_client import HEALTH_TIMEOUT, EngineClient, proxy_error
from kvbridge.proxy.metrics import CONTENT_TYPE_LATEST, ProxyMetrics
from kvbridge.proxy.prewarm import Prewarmer
from kvbridge.proxy.routing import Router

if TYPE_CHECKING:
    from kvbridge.proxy.membership import Membership

__all__ = ["ADMIN_ROUTES", "AdminRoutes", "admin_modes"]

Handler = Callable[[Request], Coroutine[Any, Any, Response]]

ADMIN_ROUTES = ("off", "token", "open")


def admin_modes(admin_routes: str | None, metrics_route: str | None,
                admin_token: str | None) -> tuple[str, str]:
    """(admin routes, /metrics) modes: ``off`` (not served), ``token`` (served behind
    ``Authorization: Bearer <admin_token>``) or ``open``. Unset: ``token`` when an admin
    token is given, else ``off``; ``/metrics`` follows the admin routes unless set."""
    admin = admin_routes or ("token" if admin_token is not None else "off")
    metrics = metrics_route or admin
    for what, mode in (("admin routes", admin), ("metrics route", metrics)):
        if mode not in ADMIN_ROUTES:
            raise ConfigError(f"{what} {mode!r}: use one of {', '.join(ADMIN_ROUTES)}")
        if mode == "token" and admin_token is None:
            raise ConfigError(f"{what} 'token' needs an admin token (--admin-token-file)")
    return admin, metrics


def _admin_only(handler: Handler, token: str) -> Handler:
    """``handler`` behind ``Authorization: Bearer <token>``."""

    async def guarded(request: Request) -> Response:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(),
                                                                 token.encode()):
            return proxy_error(401, "this route needs the proxy's admin token "
                                    "(--admin-token-file)", "authentication_error")
        return await handler(request)

    return guarded


class AdminRoutes:
    def __init__(self, router: Router, engines: EngineClient, metrics: ProxyMetrics,
                 prewarmer: Prewarmer, membership: Membership | None) -> None:
        self.router = router
        self.engines = engines
        self.metrics = metrics
        self.prewarmer = prewarmer
        self.membership = membership

    def routes(self, admin_routes: str | None, metrics_route: str | None,
               admin_token: str | None) -> list[Route]:
        """What the fleet looks like, and the proxy's counters: for operators, not users."""
        admin, metrics = admin_modes(admin_routes, metrics_route, admin_token)
        routes = []
        for mode, paths in ((admin, (("/healthz/backends", self.backends_health),
                                     ("/v1/kv/prewarm", self.prewarmer.status),
                                     ("/v1/fleet", self.fleet))),
                            (metrics, (("/metrics", self.render_metrics),))):
            if mode == "off":
                continue
            for path, handler in paths:
                if mode == "token" and admin_token is not None:
                    handler = _admin_only(handler, admin_token)
                routes.append(Route(path, handler, methods=["GET"]))
        return routes

    async def fleet(self, request: Request) -> Response:
        view = self.router.view()
        if (m := self.membership) is not None:
            view["registry"] = {"url": m.registry.endpoint.url, **m.staleness(),
                                "reads": m.registry.reads, "writes": m.registry.writes,
                                "events": m.events}
        view["background_down"] = supervised.down()  # supervised threads waiting to restart
        return JSONResponse(view)

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _probe(self, url: str) -> dict[str, Any]:
        try:
            resp = await self.engines.http.get(url + "/health", timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError as exc:
            return {"url": url, "ok": False, "status": None, "error": repr(exc)}
        return {"url": url, "ok": resp.is_success, "status": resp.status_code, "error": None}

    async def backends_health(self, request: Request) -> Response:
        prefills, decodes = self.router.urls("prefill"), self.router.urls("decode")
        results = await asyncio.gather(*(self._probe(u) for u in prefills + decodes))
        healthy = all(r["ok"] for r in results)
        body = {
            "status": "ok" if healthy else "degraded",
            "prefill": results[:len(prefills)],
            "decode": results[len(prefills):],
        }
        return JSONResponse(body, status_code=200 if healthy else 503)
