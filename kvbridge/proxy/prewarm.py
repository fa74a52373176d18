"""Prewarm: every decode handshakes with every compatible prefill before any client request
does (at start-up, and for each instance the registry adds)."""

from __future__ import annotations

import asyncio
import logging

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvbridge.proxy.background_tasks import TaskSet
from kvbridge.proxy.engine_client import EngineClient, dumps
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.rewrite import COMPLETIONS, prefill_body
from kvbridge.proxy.routing import Backend, Router

__all__ = ["PREWARM_WINDOW", "Prewarmer"]

log = logging.getLogger(__name__)

PREWARM_WINDOW = 300.0  # seconds the proxy keeps trying to reach engines that are starting


class Prewarmer:
    def __init__(self, router: Router, engines: EngineClient, metrics: ProxyMetrics,
                 tasks: TaskSet, kv_token: str | None) -> None:
        self.router = router
        self.engines = engines
        self.metrics = metrics
        self.tasks = tasks
        self.kv_token = kv_token
        # (prefill url, decode url) -> "ok" or the reason it failed; filled in the background
        self.prewarmed: dict[tuple[str, str], str] = {}
        self.done = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None  # set while the app runs

    def backend_added(self, backend: Backend) -> None:
        """A new instance (from the registry): prewarm its pairs, from any thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._prewarm_new, backend)

    def _prewarm_new(self, backend: Backend) -> None:
        others = self.router.backends("decode" if backend.serves("prefill") else "prefill")
        pairs = [(backend.url, o.url) if backend.serves("prefill") else (o.url, backend.url)
                 for o in others if o.compatible(backend) and o.url != backend.url]
        for p, d in pairs:
            self.tasks.spawn(self.prewarm_pair(p, d))

    async def prewarm_all(self) -> None:
        """Tell every decode to handshake with every prefill now, so that no client
        request pays for it. Engines still starting are retried for ``PREWARM_WINDOW``
        seconds; engines that do not offer it (4xx) are skipped."""
        try:
            await asyncio.gather(*(self.prewarm_pair(p, d) for p in self.router.urls("prefill")
                                   for d in self.router.urls("decode")))
        finally:
            self.done.set()

    async def prewarm_pair(self, p_url: str, d_url: str) -> None:
        client = self.engines.http
        deadline = asyncio.get_running_loop().time() + PREWARM_WINDOW
        headers = {"authorization": f"Bearer {self.kv_token}"} if self.kv_token else {}
        delay = 0.2
        while True:
            try:
                r = await client.get(p_url + "/v1/kv/info")
                if r.status_code == 404:  # a vLLM engine: no prewarm route, so warm up
                    r = await self._warm_up(p_url, d_url)
                elif r.status_code == 200:
                    info = r.json()
                    body = {"host": info["side_channel_host"],
                            "port": info["side_channel_port"],
                            "method": info["handshake_method"], "wait": True}
                    r = await client.post(d_url + "/v1/kv/prewarm", json=body, headers=headers)
                outcome = "ok" if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
                if r.status_code < 500:
                    break  # done, or refused for good (no such route, wrong token)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                outcome = f"{type(e).__name__}: {e}"
            if asyncio.get_running_loop().time() + delay > deadline:
                break
            await asyncio.sleep(delay)  # an engine still starting: try again shortly
            delay = min(2 * delay, 2.0)
        self.prewarmed[(p_url, d_url)] = outcome
        if outcome.startswith(("401", "403")):
            # Every first request to each pair will pay for the handshake: say so loudly,
            # with what to fix. A 401 is the token; a 403 is the proxy's client
            # certificate (the decode's ssl_allowed_peers) or the token's scopes, as the
            # decode's answer (in the outcome) says.
            self.metrics.prewarm_failures.labels("unauthorized").inc()
            hint = ("give the proxy the side-channel token (--kv-token-file)"
                    if outcome.startswith("401") else "the decode does not allow the proxy's "
                    "client certificate (--client-cert) or its token's scope: see its answer")
            log.error("prewarm of %s with %s refused (%s): %s", d_url, p_url, outcome, hint)
        elif outcome != "ok":
            self.metrics.prewarm_failures.labels("other").inc()
            log.warning("prewarm of %s with %s: %s", d_url, p_url, outcome)

    async def _warm_up(self, p_url: str, d_url: str) -> httpx.Response:
        """A one-token P/D request through the pair: how an engine without kvbridge's
        prewarm route (vLLM, with or without the plug-in) handshakes before any client
        request does. The prefill's blocks are read and freed as for any request."""
        client = self.engines.http
        r = await client.get(p_url + "/v1/models")
        if r.status_code != 200:
            return r
        body = {"model": r.json()["data"][0]["id"], "prompt": "Hello", "max_tokens": 1,
                "temperature": 0}
        r = await client.post(p_url + COMPLETIONS, content=dumps(
            prefill_body(body, COMPLETIONS)), headers={"content-type": "application/json"})
        if r.status_code != 200:
            return r
        body["kv_transfer_params"] = r.json().get("kv_transfer_params")
        return await client.post(d_url + COMPLETIONS, content=dumps(body),
                                 headers={"content-type": "application/json"})

    async def status(self, request: Request) -> Response:
        """``GET /v1/kv/prewarm`` (an admin route)."""
        return JSONResponse({"done": self.done.is_set(), "pairs": [
            {"prefill": p, "decode": d, "outcome": o} for (p, d), o in self.prewarmed.items()]})
