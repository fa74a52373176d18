"""The proxy's Prometheus counters (served on ``/metrics`` when that route is on)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from kvbridge import supervised
from kvbridge.guard import GuardCollector

__all__ = ["CONTENT_TYPE_LATEST", "ProxyMetrics"]


class ProxyMetrics:
    """One registry per proxy app: its own counters, its server's connection budget and the
    supervised background threads."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvbridge_proxy_requests", "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.prefill_seconds = Histogram("kvbridge_proxy_prefill_seconds",
                                         "Duration of the prefill hop", registry=r)
        self.upstream_errors = Counter("kvbridge_proxy_upstream_errors",
                                       "Engines that could not be reached, by hop", ["stage"],
                                       registry=r)
        self.prewarm_failures = Counter(
            "kvbridge_proxy_prewarm_failures",
            "Decode/prefill pairs whose prewarm failed, by reason", ["reason"], registry=r)
        r.register(GuardCollector())  # the proxy server's connection budget
        r.register(supervised.BackgroundCollector())
        self.releases = Counter("kvbridge_proxy_kv_releases",
                                "Prefill holds released after a failed decode hop, by outcome",
                                ["outcome"], registry=r)
        self.failovers = Counter("kvbridge_proxy_failovers",
                                 "Requests retried on another instance, by failed hop",
                                 ["stage"], registry=r)
        self.first_token_from = Counter(
            "kvbridge_proxy_first_token_from",
            "Streamed answers whose first token came straight from the prefill", ["source"],
            registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
