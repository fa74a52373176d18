"""The guard on uvicorn: the HTTP protocol every kvbridge server runs with its budget
(deadlines, the cap, head limits), and a server whose TLS handshake is bounded too."""

from __future__ import annotations

import asyncio
import select
import socket
from typing import Any

import uvicorn

from kvbridge.bounded_http import BoundedHttpTools
from kvbridge.guard.connections import ConnectionGuard
from kvbridge.settings import ConnectionBudget

__all__ = ["PEER_CERT", "GuardedServer", "guarded_config", "guarded_protocol"]


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
