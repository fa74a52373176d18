"""Connection budgets for every HTTP server kvbridge runs (side channel, engine API, proxy).

uvicorn closes a keep-alive connection only after a response: a connection that never
sends a byte, or sends its request head a byte at a time (slowloris), stays open for
good, and enough of them fill ``limit_concurrency`` so that every real request gets 503.
The guard wraps uvicorn's HTTP protocol and adds, per connection and per server:

* a deadline for the first byte of a request after the connection is made (after the
  TLS handshake on https);
* a deadline for a complete request head once its first byte arrived, and one for the
  body once the head is complete;
* the keep-alive timeout between requests (uvicorn's own timer, set from the budget);
* a cap on connections: at the cap, the connection idle the longest is closed to make
  room for the new one; if none is idle, the oldest whose request head or body is still
  incomplete. Connections serving a request are never evicted;
* a cap on each request head, in bytes and in header lines (``max_head_bytes``,
  ``max_headers``): 431, counted as the head arrives.

It also bounds the TLS handshake (``GuardedServer``) and gives the heap back after bursts
of closed connections (``_Trimmer``). The protocol it wraps is ``kvbridge.bounded_http``'s
(or a subclass: the side channel's), which enforces the head cap and stops reading while
the client leaves answers unread or requests wait behind one in progress.

    budget = ConnectionBudget.load()  # kvbridge/settings: flags, environment, defaults
    uvicorn.Config(app, **guarded_config("api", budget))  # or, for a protocol of one's own:
    uvicorn.Config(app, http=guarded_protocol(BoundedHttpTools, budget, "api"),
                   timeout_keep_alive=budget.keep_alive_timeout)
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import select
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvbridge.bounded_http import BoundedHttpTools
from kvbridge.settings import ConnectionBudget

__all__ = [
    "PEER_CERT",
    "ConnectionBudget",
    "ConnectionGuard",
    "GuardCollector",
    "GuardMirror",
    "GuardedServer",
    "guard_stats",
    "guarded_config",
    "guarded_protocol",
]

log = logging.getLogger(__name__)

class ConnectionGuard:
    """The connections of one server, least recently active first."""

    def __init__(self, budget: ConnectionBudget, name: str) -> None:
        self.budget = budget
        self.name = name
        self._conns: dict[_GuardMixin, None] = {}
        self.evicted = 0  # closed to make room at the cap
        self.timed_out = 0  # closed for a missed first-byte, head or body deadline
        self.dropped = 0  # closed for a message over the limits (zmq side channel)
        _GUARDS.add(self)

    def __len__(self) -> int:
        return len(self._conns)

    def admit(self, conn: _GuardMixin) -> None:
        if len(self._conns) >= self.budget.max_connections:
            victim = None
            for old in self._conns:  # least recently active first
                state = old._guard_state()
                if state == "idle":
                    victim = old
                    break
                if state == "head" and victim is None:
                    victim = old  # a head still incomplete: closed only if none is idle
            if victim is not None:
                self.evicted += 1
                if self.evicted == 1 or self.evicted % 1000 == 0:
                    log.warning(
                        "%s: %d connections (the cap): closed the one idle the longest (%d so far)",
                        self.name,
                        len(self._conns),
                        self.evicted,
                    )
                self.remove(victim)
                victim._guard_close()
        self._conns[conn] = None

    def touch(self, conn: _GuardMixin) -> None:
        """``conn`` just became idle: it is now the newest idle connection."""
        if self._conns.pop(conn, False) is None:
            self._conns[conn] = None

    def remove(self, conn: _GuardMixin) -> None:
        if self._conns.pop(conn, False) is None:
            _TRIMMER.closed()


_GUARDS: weakref.WeakSet[ConnectionGuard] = weakref.WeakSet()


GuardStats = tuple[int, int, int, int]  # open, evicted, timed_out, dropped


def guard_stats() -> dict[str, GuardStats]:
    """Every live guard of this process, summed by server name (what a side-channel
    process reports to its parent)."""
    out: dict[str, GuardStats] = {}
    for g in list(_GUARDS):
        o, e, t, d = out.get(g.name, (0, 0, 0, 0))
        out[g.name] = (o + len(g), e + g.evicted, t + g.timed_out, d + g.dropped)
    return out


class GuardMirror:
    """Another process's guard, as that process reports it (the side-channel process):
    counted by ``GuardCollector`` here. Its counters stay monotonic across that
    process's restarts (a new one counts from zero). Keep a reference: guards are held
    weakly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._open = 0
        self._base = (0, 0, 0)
        self._last = (0, 0, 0)
        _GUARDS.add(self)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._open

    def update(self, stats: GuardStats) -> None:
        self._open, *last = stats
        self._last = (last[0], last[1], last[2])

    def restarted(self) -> None:
        """The process restarted: what it counted so far stays counted."""
        self._base = tuple(b + x for b, x in zip(self._base, self._last, strict=True))
        self._last, self._open = (0, 0, 0), 0

    evicted = property(lambda self: self._base[0] + self._last[0])
    timed_out = property(lambda self: self._base[1] + self._last[1])
    dropped = property(lambda self: self._base[2] + self._last[2])


class GuardCollector:
    """Prometheus collector of every live guard of the process, by server name: open
    connections and connections the guard closed, by why."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        open_: dict[str, int] = {}
        closed: dict[tuple[str, str], int] = {}
        for g in list(_GUARDS):
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


class _Trimmer:
    """Gives freed heap back to the OS after a burst of closed connections.

    A closed TLS connection's buffers and SSL state wait for the cycle collector, and once
    freed glibc keeps the pages in its arenas: after a flood of mutual-TLS connections the
    process stayed near its peak for good. A collection and ``malloc_trim`` give them
    back; they take milliseconds, so they run at most once a second and only after
    ``BURST`` connections closed."""

    BURST = 256

    def __init__(self) -> None:
        self._closed = 0
        self._scheduled = False
        self._trim: Any = None
        try:
            self._trim = ctypes.CDLL(None).malloc_trim  # glibc only
        except (OSError, AttributeError):
            pass

    def closed(self) -> None:
        self._closed += 1
        if self._trim is None or self._scheduled or self._closed < self.BURST:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = True
        loop.call_later(1.0, self._run)

    def _run(self) -> None:
        self._closed, self._scheduled = 0, False
        # Closed transports and their protocols reference each other: only the cycle
        # collector frees them (and their SSL objects), and an idle server rarely runs it.
        gc.collect()
        self._trim(0)


_TRIMMER = _Trimmer()


# The scope key under which a request carries its connection's verified client
# certificate (``ssl.SSLSocket.getpeercert()``; None without TLS or without one): what
# authorization is decided on (``kvbridge.handshake.authz``), on every guarded server.
PEER_CERT = "kvbridge.peer_cert"


class _GuardMixin:
    """Goes before ``BoundedHttpTools`` (or a subclass) in the bases."""

    guard: ConnectionGuard
    # provided by the uvicorn protocol
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    pipeline: Any
    connections: set[Any]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._guard_timer: asyncio.TimerHandle | None = None
        self._guard_in_head = False
        self._guard_in_body = False
        self.guard.admit(self)
        self._guard_arm(self.guard.budget.first_byte_timeout)

    def data_received(self, data: bytes) -> None:
        if self._guard_state() == "idle":
            # The first bytes of a request head: it has head_timeout to be complete.
            self._guard_in_head = True
            self._guard_arm(self.guard.budget.head_timeout)
        super().data_received(data)  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        self.scope[PEER_CERT] = self._guard_peer_cert()  # type: ignore[attr-defined]
        self._guard_in_head = False
        # The body (if any) has body_timeout to arrive; on_message_complete ends it.
        self._guard_in_body = True
        self._guard_arm(self.guard.budget.body_timeout)
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._guard_in_body = False
        self._guard_cancel()
        super().on_message_complete()  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        # Idle again: uvicorn's keep-alive timer (keep_alive_timeout) now runs.
        self.guard.touch(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_cancel()
        self.guard.remove(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def timeout_keep_alive_handler(self) -> None:
        # After the process was stopped (SIGSTOP, a long GC pause), uvloop runs expired
        # timers before it reads sockets: a request that arrived meanwhile would be cut
        # unread ("Server disconnected without sending a response"). Wait for it instead.
        if self._guard_pending():
            self.timeout_keep_alive_task = self.loop.call_later(  # type: ignore[attr-defined]
                self.guard.budget.keep_alive_timeout, self.timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()  # type: ignore[misc]

    def _guard_peer_cert(self) -> dict | None:
        if not hasattr(self, "_guard_cert"):  # once per connection
            ssl_object = self.transport.get_extra_info("ssl_object")
            self._guard_cert = None if ssl_object is None else ssl_object.getpeercert()
        return self._guard_cert

    def _guard_pending(self) -> bool:
        """Bytes (or an EOF) wait unread in the socket."""
        sock = self.transport.get_extra_info("socket")
        try:
            poller = select.poll()  # not select.select: descriptors past 1024 are common here
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError, AttributeError):
            return False

    def _guard_state(self) -> str:
        """``idle`` (nothing in flight), ``head`` (a request head or body still incomplete)
        or ``busy`` (a request being served: never closed by the guard)."""
        if self._guard_in_head or self._guard_in_body:
            return "head"
        if self.pipeline or not (self.cycle is None or self.cycle.response_complete):
            return "busy"
        return "idle"

    def _guard_arm(self, delay: float) -> None:
        self._guard_cancel()
        self._guard_timer = self.loop.call_later(delay, self._guard_expired)

    def _guard_cancel(self) -> None:
        if self._guard_timer is not None:
            self._guard_timer.cancel()
            self._guard_timer = None

    def _guard_expired(self) -> None:
        self._guard_timer = None
        if self._guard_in_body:  # a body trickled in too slowly: the app sees a disconnect
            self.guard.timed_out += 1
            self._guard_close()
            return
        if not self._guard_in_head and self._guard_pending():
            self._guard_arm(self.guard.budget.first_byte_timeout)  # see the keep-alive timer
            return
        if self._guard_in_head or (self.cycle is None and not self.pipeline):
            self.guard.timed_out += 1
            self._guard_close()

    def _guard_close(self) -> None:
        # abort, not close: an idle TLS peer never answers close_notify, and until it
        # would, the connection keeps its memory and its place in uvicorn's count.
        self._guard_cancel()
        self.connections.discard(self)
        self.transport.abort()


def guarded_protocol(base: type[BoundedHttpTools], budget: ConnectionBudget,
                     name: str) -> type:
    """A subclass of ``base`` (``BoundedHttpTools`` or a subclass) with its own
    ``ConnectionGuard`` (one per server: pass it as uvicorn's ``http``) and the budget's
    request-head caps (bytes at most ``base.head_ceiling``). The guard is the class's
    ``guard``."""
    head = budget.max_head_bytes
    if base.head_ceiling is not None:
        head = min(head, base.head_ceiling)
    return type(f"Guarded{base.__name__}", (_GuardMixin, base), {
        "guard": ConnectionGuard(budget, name), "head_limit": head,
        "header_limit": budget.max_headers})


def guarded_config(name: str, budget: ConnectionBudget | None = None) -> dict[str, Any]:
    """uvicorn ``Config`` keywords for a server under ``budget`` (default: the tree's, from
    the environment): its guarded httptools protocol and keep-alive timeout."""
    budget = budget or ConnectionBudget.load()
    return {
        "http": guarded_protocol(BoundedHttpTools, budget, name),
        "timeout_keep_alive": budget.keep_alive_timeout,
    }


class GuardedServer(uvicorn.Server):
    """uvicorn's server, with the TLS handshake bounded by the first-byte deadline.

    The guard sees a TLS connection only once its handshake is done; before that asyncio
    gives a silent client 60 s. Under the guard's protocol this server passes
    ``first_byte_timeout`` as the handshake timeout instead."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        guard = getattr(self.config.http_protocol_class, "guard", None)
        if guard is None or self.config.ssl is None:
            await super().startup(sockets)
            return
        loop = asyncio.get_running_loop()
        create_server = loop.create_server

        def bounded(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("ssl_handshake_timeout", guard.budget.first_byte_timeout)
            return create_server(*args, **kwargs)

        loop.create_server = bounded  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server  # back to the loop's own method
