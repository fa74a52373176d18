"""The HTTP/1.1 protocol every kvbridge server runs: uvicorn's httptools one, with reading
bounded by what the connection's client has not read yet.

uvicorn pauses reading while a request waits behind another on its connection (HTTP
pipelining), but a single read (up to 256 KiB) is parsed whole: thousands of tiny
pipelined requests became thousands of queued requests at once (4 KiB each). And a request
answered in the protocol (the side channel's fast path) was written whatever the client
read, reading resumed after each: a client that pipelined ``GET /healthz`` and never
read grew the process by its answers, without bound.

``BoundedHttpTools`` parses what it reads ``FEED_BYTES`` at a time. Between two pieces it
stops while reading is paused (a request waiting behind one in progress, a body the app
has not taken, or writes paused) and holds the rest of the read, then pauses the socket:
per connection, at most one read is held and ``FEED_BYTES`` of requests are queued. Reading
pauses while writes are (the transport's buffer is past its high-water mark, 64 KiB) and
resumes once they resume; the held bytes are parsed before the socket is read again.

A connection also begins at most ``TURN_REQUESTS`` requests per turn of the event loop: a
read of 256 KiB of pipelined ``GET`` requests was thousands of requests answered before any other
connection was served (a legitimate fetch waited 5 s behind two such clients), and the
timers each armed and cancelled were only freed after the turn (tens of MiB at once).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["FEED_BYTES", "TURN_REQUESTS", "BoundedHttpTools"]

# Bytes parsed at a time: at most this many bytes of tiny pipelined requests are queued
# before the protocol stops to look whether it may go on.
FEED_BYTES = 4096
# Requests a connection may begin in one turn of the event loop: past them, the rest of
# the read waits for the next turn, after the other connections' (and the timers each
# request armed and cancelled are freed meanwhile).
TURN_REQUESTS = 64


class _Flow(FlowControl):
    """uvicorn's flow control, with reading paused while writes are, and the socket
    resumed only once the bytes held back were parsed."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedHttpTools) -> None:
        super().__init__(transport)
        self._protocol = protocol
        self._socket_paused = False

    def pause_reading(self) -> None:
        self.read_paused = True
        self.pause_socket()

    def resume_reading(self) -> None:
        if self.write_paused or not self.read_paused:
            return  # (resume_writing resumes it)
        self.read_paused = False
        if self._protocol._held:
            # not parsed here: uvicorn resumes reading from inside the parser's callbacks
            self._protocol.loop.call_soon(self._protocol._release)
        else:
            self.resume_socket()

    def pause_socket(self) -> None:
        """Pause the socket alone (a turn of the loop for the other connections)."""
        if not self._socket_paused:
            self._socket_paused = True
            self._transport.pause_reading()

    def resume_socket(self) -> None:
        if self._socket_paused and not self.read_paused:
            self._socket_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self._protocol.pipeline:  # (else the request in progress resumes it)
            self.resume_reading()


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, parsing ``FEED_BYTES`` at a time while reading may go
    on (see the module)."""

    flow: _Flow

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = b""  # read, not parsed yet: reading was paused meanwhile
        self._running: Any = None  # the request whose app task runs
        self._begun = 0  # requests begun on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self)

    def data_received(self, data: bytes) -> None:
        if self._held:  # (the socket is paused: only in a race with pausing it)
            self._held += data
            return
        view = memoryview(data)
        begun = self._begun
        for start in range(0, len(data), FEED_BYTES):
            if self.flow.read_paused:
                self._held = bytes(view[start:])
                return
            if self._begun - begun >= TURN_REQUESTS:  # the other connections' turn
                self._held = bytes(view[start:])
                self.flow.pause_socket()
                self.loop.call_soon(self._release)
                return
            super().data_received(view[start:start + FEED_BYTES])  # type: ignore[arg-type]
            if self.parser is None or self.transport.is_closing() or \
                    self.transport.get_protocol() is not self:  # closed, refused, upgraded
                return

    def _release(self) -> None:
        """Parse the bytes held back, as if they had just arrived, then read again."""
        held, self._held = self._held, b""
        if self.parser is None or self.transport.is_closing():
            return
        if held:
            self.data_received(held)  # (through the guard's hooks too)
        if not self._held:
            self.flow.resume_socket()

    def on_message_begin(self) -> None:
        self._begun += 1
        super().on_message_begin()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def shutdown(self) -> None:
        if self.flow.write_paused:
            # a client that reads nothing would hold the server's shutdown until uvicorn
            # cancels the request (a traceback in the log)
            self.transport.abort()
            return
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn marks only the newest request disconnected: one whose answer waited for
        # writes to resume, behind which others were queued, would then write to the
        # closed transport (an error and a traceback in the log).
        for cycle in [self._running, *(c for c, _ in self.pipeline)]:
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
        self._held = b""
        super().connection_lost(exc)
