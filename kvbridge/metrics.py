"""Prometheus metrics of one instance, in a registry of its own (several instances may
share a process in tests)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvbridge.guard import GuardCollector
from kvbridge.supervised import BackgroundCollector

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
        self.kv_notes_ignored = Counter(
            "kvbridge_kv_notes_ignored",
            "Release and READ-done notes about held blocks that were ignored, by why "
            "(bad_key: without this hold's key)", ["why"], registry=r)
        self.kv_loads_stale = Counter(
            "kvbridge_kv_loads_stale",
            "KV loads whose blocks' tags did not match the prompt after the READ (reordered "
            "blocks, another prompt, blocks reused): not used", registry=r)
        self.requests_recomputed = Counter(
            "kvbridge_requests_recomputed",
            "Requests whose remote KV failed to load and were computed locally", registry=r)
        self.side_channel_requests = Counter(
            "kvbridge_side_channel_requests", "Side-channel requests by route and status",
            ["route", "status"], registry=r)
        self.metadata_bytes_served = Counter(
            "kvbridge_metadata_bytes_served", "Handshake metadata bytes the side channel sent",
            registry=r)
        self.request_phase_seconds = Histogram(
            "kvbridge_request_phase_seconds",
            "Where a request's time to first token goes, inside the engine: queue (arrived to "
            "blocks allocated for its remote KV, or to scheduled), kv_load (to KV loaded), "
            "after_load (to scheduled), first_step (to the first token), and the whole "
            "time_to_first_token", ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.held_requests = Gauge("kvbridge_held_requests",
                                   "Prefill requests holding blocks for a decode", registry=r)
        # Connection budgets of this process's servers (side channel, engine API).
        r.register(GuardCollector())
        # Supervised background threads of this process, and outside inputs ignored.
        r.register(BackgroundCollector())

    def observe_side_channel(self, route: str, status: int, nbytes: int) -> None:
        """``handshake.base.Observer``: called from the side channel's thread."""
        self.side_channel_requests.labels(route, str(status)).inc()
        if status == 200 and route.startswith("handshake"):
            self.metadata_bytes_served.inc(nbytes)

    def observe_phases(self, times: dict[str, float]) -> None:
        """``AsyncEngine``'s phase observer: ``RequestOutput.times`` of a first token."""
        phases = self.request_phase_seconds
        t = times
        started = t.get("load_started", t.get("scheduled"))
        if started is None or "arrived" not in t or "first_token" not in t:
            return
        phases.labels("queue").observe(started - t["arrived"])
        if "load_started" in t and "kv_loaded" in t and "scheduled" in t:
            phases.labels("kv_load").observe(t["kv_loaded"] - t["load_started"])
            phases.labels("after_load").observe(t["scheduled"] - t["kv_loaded"])
        if "scheduled" in t:
            phases.labels("first_step").observe(t["first_token"] - t["scheduled"])
        phases.labels("time_to_first_token").observe(t["first_token"] - t["arrived"])

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
