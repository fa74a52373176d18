"""Prometheus metrics of one instance, in a registry of its own (several instances may
share a process in tests)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.handshake_seconds = Histogram(
            "kvbridge_handshake_seconds", "Handshake duration (fetch + adding the remote agent)",
            ["method", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_loads = Counter("kvbridge_kv_loads", "Remote KV loads by outcome",
                                ["outcome"], registry=r)
        self.kv_load_seconds = Histogram(
            "kvbridge_kv_load_seconds", "From blocks allocated to KV arrived on every rank",
            buckets=LATENCY_BUCKETS, registry=r)
        self.kv_bytes_loaded = Counter("kvbridge_kv_bytes_loaded", "KV bytes read from peers",
                                       registry=r)
        self.kv_blocks_loaded = Counter("kvbridge_kv_blocks_loaded",
                                        "KV blocks read from peers", registry=r)
        self.held_released = Counter(
            "kvbridge_held_requests_released",
            "Prefill requests whose held blocks were freed, by why", ["why"], registry=r)
        self.requests_recomputed = Counter(
            "kvbridge_requests_recomputed",
            "Requests whose remote KV failed to load and were computed locally", registry=r)
        self.side_channel_requests = Counter(
            "kvbridge_side_channel_requests", "Side-channel requests by route and status",
            ["route", "status"], registry=r)
        self.metadata_bytes_served = Counter(
            "kvbridge_metadata_bytes_served", "Handshake metadata bytes the side channel sent",
            registry=r)
        self.held_requests = Gauge("kvbridge_held_requests",
                                   "Prefill requests holding blocks for a decode", registry=r)

    def observe_side_channel(self, route: str, status: int, nbytes: int) -> None:
        """``handshake.base.Observer``: called from the side channel's thread."""
        self.side_channel_requests.labels(route, str(status)).inc()
        if status == 200 and route.startswith("handshake"):
            self.metadata_bytes_served.inc(nbytes)

    def track_blocks(self, free: Callable[[], int], total: int) -> None:
        """Block gauges read at scrape time."""
        Gauge("kvbridge_blocks_free", "Free KV blocks",
              registry=self.registry).set_function(lambda: free())
        Gauge("kvbridge_blocks_used", "KV blocks in use",
              registry=self.registry).set_function(lambda: total - free())

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when never observed)."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
