"""The HTTP/1.1 protocol every kvbridge server runs (side channel, engine API, proxy):
uvicorn's httptools one, with a cap on each request head and reading bounded by what the
connection's client has not read yet.

**Request heads.** httptools (llhttp) has no limit on how large a head may grow (unlike
uvicorn's h11 protocol with ``h11_max_incomplete_event_size``), and uvicorn keeps every
header: one connection sending 24 MiB of tiny header lines grew the proxy by 580 MiB. A
head is refused with 431 once it passes ``head_limit`` bytes or ``header_limit`` header
lines (the server's budget: ``max_head_bytes``, ``max_headers``), counted as it arrives:
as parsed (request target and headers) and, while the head is incomplete, as received
(one endless line, which the parser buffers). Trailers of a chunked body count as
headers of their request, and bytes received during a body with no body data among them
(an endless trailer or chunk-size line) as its head. A refused connection lingers before it closes: closed with the
client's bytes still arriving, it would be reset, and the client might never read the
answer. What it sends meanwhile is dropped, up to ``LINGER_BYTES`` or ``LINGER_SECONDS``.

**Reading.**
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
import json
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvbridge.errors import error_body
from kvbridge.settings import SETTINGS

__all__ = ["FEED_BYTES", "LINGER_BYTES", "LINGER_SECONDS", "TURN_REQUESTS", "BoundedHttpTools",
           "refusal"]

# Bytes parsed at a time: at most this many bytes of tiny pipelined requests are queued
# before the protocol stops to look whether it may go on.
FEED_BYTES = 4096
# Requests a connection may begin in one turn of the event loop: past them, the rest of
# the read waits for the next turn, after the other connections' (and the timers each
# request armed and cancelled are freed meanwhile).
TURN_REQUESTS = 64
# What a refused connection may still send (dropped) before it is closed: more than its
# socket buffers held when it was refused (megabytes on loopback), or the close resets
# the connection before the client read the answer.
LINGER_BYTES = 8 << 20
LINGER_SECONDS = 1.0


def refusal(status: bytes, message: str) -> bytes:
    """A whole answer that closes the connection, in the error shape of every server."""
    body = json.dumps(error_body(message, "invalid_request_error")).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, len(body))) + body


_431 = refusal(b"431 Request Header Fields Too Large", "request head is too long")
_431_COUNT = refusal(b"431 Request Header Fields Too Large", "too many header lines")
_431_FRAMING = refusal(b"431 Request Header Fields Too Large",
                       "chunk framing or trailers too long")


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
    """uvicorn's httptools protocol with a cap on request heads, parsing ``FEED_BYTES`` at
    a time while reading may go on (see the module).

    A subclass refuses a request by setting ``_refused`` (and ``_refusal``, the answer) in
    a parser callback: it is answered (unless the app already did) and the connection
    closed after the linger."""

    # a server's own, from its budget (kvbridge.guard.guarded_protocol)
    head_limit: int = SETTINGS["max_head_bytes"].default
    header_limit: int = SETTINGS["max_headers"].default
    # the most a subclass's requests ever need, whatever the budget (None: no ceiling)
    head_ceiling: int | None = None
    flow: _Flow

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = b""  # read, not parsed yet: reading was paused meanwhile
        self._running: Any = None  # the request whose app task runs
        self._begun = 0  # requests begun on this connection
        self._in_head = True
        self._in_body = False
        # bytes read while this head was incomplete, or since the body's last data
        self._received = 0
        self._parsed = 0  # bytes of request target and header lines parsed so far
        self._lines = 0  # header lines (and trailers) of this request so far
        self._refused = False
        self._refusal = _431  # the answer a refused request gets, if none was sent
        self._dropped = 0  # bytes dropped since the refusal
        self._app_has_it = False  # this request's head went to the app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering: dropped
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
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
            piece = view[start:start + FEED_BYTES]
            if self._in_head or self._in_body:
                self._received += len(piece)
            super().data_received(piece)  # type: ignore[arg-type]
            if self._received > self.head_limit and (self._in_head or self._in_body):
                self._refused = True
                if self._in_body:
                    self._refusal = _431_FRAMING
            if self._refused:
                self._refuse()
                return
            if self.parser is None or self.transport.is_closing() or \
                    self.transport.get_protocol() is not self:  # closed, upgraded
                return

    def _refuse(self) -> None:
        """Answer the refused request (unless the app did), then linger and close."""
        transport = self.transport
        if transport.is_closing():
            return
        # (the cycle is this request's only once its head reached the app)
        cycle = self.cycle if self._app_has_it else None
        running = self._running
        if running is not None and running is not cycle and not running.response_complete:
            # an earlier request (pipelined) is being answered: no refusal in its middle
            running.disconnected = True
            transport.close()
            return
        if cycle is None or not cycle.response_started:
            transport.write(self._refusal)
        if cycle is not None:
            cycle.disconnected = True  # the app's answer, if it comes, goes nowhere
        if transport.can_write_eof():  # plain TCP: the client sees the end at once
            transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, transport.close)

    def _count(self, n: int) -> bool:
        """Add ``n`` parsed bytes of head; False (and the request refused) once over."""
        self._parsed += n
        if self._parsed > self.head_limit:
            self._refused = True
        return not self._refused

    def _release(self) -> None:
        """Parse the bytes held back, as if they had just arrived, then read again."""
        held, self._held = self._held, b""
        if self.parser is None or self.transport.is_closing():
            return
        if held:
            self.data_received(held)  # (through the guard's hooks too)
        if not self._held:
            self.flow.resume_socket()

    # -- parser callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._begun += 1
        self._in_head, self._received, self._parsed, self._lines = True, 0, 0, 0
        self._app_has_it = False
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._count(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._lines += 1
        if self._lines > self.header_limit:
            self._refused, self._refusal = True, _431_COUNT
            return
        if self._count(len(name) + len(value) + 4):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._in_body, self._received = False, True, 0
        if self._refused:  # a refused request never reaches the app
            return
        super().on_headers_complete()
        self._app_has_it = True

    def on_body(self, body: bytes) -> None:
        self._received = 0
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if not self._refused:
            super().on_message_complete()

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
