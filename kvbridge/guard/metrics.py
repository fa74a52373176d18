"""The guards' figures for Prometheus: open connections and connections closed, by
server and why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvbridge.guard.connections import GUARDS

__all__ = ["GuardCollector"]


class GuardCollector:
    """Prometheus collector of every live guard of the process, by server name: open
    connections and connections the guard closed, by why."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        open_: dict[str, int] = {}
        closed: dict[tuple[str, str], int] = {}
        for g in list(GUARDS):
            open_[g.name] = open_.get(g.name, 0) + len(g)
            for why in ("evicted", "timed_out", "dropped"):
                closed[(g.name, why)] = closed.get((g.name, why), 0) + getattr(g, why)
        gauge = GaugeMetricFamily(
            "kvbridge_connections", "Open connections, by server", labels=["server"]
        )
        for name, n in sorted(open_.items()):
            gauge.add_metric([name], n)
        counter = CounterMetricFamily(
            "kvbridge_connections_closed",
            "Connections closed by the connection budget: evicted at the cap, timed_out at "
            "a first-byte/head/body deadline, dropped for a message over the limits",
            labels=["server", "why"],
        )
        for (name, why), n in sorted(closed.items()):
            counter.add_metric([name, why], n)
        yield gauge
        yield counter
