"""Releasing a prefill's held KV blocks when no decode will read them."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from kvbridge.server.proxy.engine_client import HEALTH_TIMEOUT, EngineClient, dumps
from kvbridge.server.proxy.metrics import ProxyMetrics
from kvbridge.server.proxy.tasks import TaskSet

__all__ = ["Releaser"]

log = logging.getLogger(__name__)


class Releaser:
    def __init__(self, engines: EngineClient, metrics: ProxyMetrics, tasks: TaskSet,
                 kv_token: str | None) -> None:
        self.engines = engines
        self.metrics = metrics
        self.tasks = tasks
        self.kv_token = kv_token

    def later(self, prefill: str, kv_params: Any, request_id: str) -> None:
        """Release in the background (the client's answer does not wait for it)."""
        self.tasks.spawn(self.release(prefill, kv_params, request_id))

    async def release(self, prefill: str, kv_params: Any, request_id: str) -> None:
        """Tell the prefill to free the request's held blocks now rather than at the end
        of their lease (best effort: the lease still bounds them if this fails)."""
        headers = {"authorization": f"Bearer {self.kv_token}"} if self.kv_token else {}
        try:
            r = await self.engines.http.post(
                prefill + "/v1/kv/release", content=dumps(kv_params),
                headers={**headers, "content-type": "application/json"}, timeout=HEALTH_TIMEOUT)
            outcome = "ok" if r.status_code == 200 else str(r.status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        self.metrics.releases.labels(outcome).inc()
        if outcome != "ok":
            log.warning("request %s: releasing its blocks on %s failed: %s", request_id,
                        prefill, outcome)
