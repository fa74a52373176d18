"""The side-channel server's HTTP/1.1 protocol: uvicorn's httptools one with a cap on the
request head and on the request body.

httptools (llhttp) parses faster than h11 but, unlike uvicorn's h11 protocol with
``h11_max_incomplete_event_size``, has no limit on how large a head may grow. Requests of
the side channel carry a path, a token and a few headers: a head over the limit is
answered 431 and the connection closed, whether it came in one read or trickled in.

A body is counted as it streams: a chunked one declares no length for the app to refuse
up front, and uvicorn discards what an answered request still sends, for as long as the
client sends it. Past the limit the request is answered 413 (unless the app already
answered) and the connection closed.

A request ``responder`` can answer (``kvbridge.handshake.http_fast``: a handshake, the
probes) is answered here, from the parsed head, without an ASGI task; any other goes to the
app as before. Requests answered in order: one waits behind an app request still running
on its connection (HTTP pipelining) by going to the app too. So does one that arrives
while writes are paused (the client has not read 64 KiB of answers): the app's answer
waits until they are read, and reading stops meanwhile (``kvbridge.bounded_http``), so
a client that pipelines requests and never reads the answers holds at most that much.

A refused connection lingers before it closes: closed with the client's bytes still
arriving, it would be reset, and the client might never read the answer. What it sends
meanwhile is dropped, up to ``LINGER_BYTES`` or ``LINGER_SECONDS``.
"""

from __future__ import annotations

import json

from kvbridge.bounded_http import BoundedHttpTools
from kvbridge.errors import error_body
from kvbridge.guard import PEER_CERT
from kvbridge.handshake.base import MAX_REQUEST_BYTES
from kvbridge.handshake.http_fast import Answer, Responder


def _reply(status: bytes, message: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error")).encode()
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, len(body))) + body


LINGER_BYTES = 1 << 20
LINGER_SECONDS = 1.0

_431 = _reply(b"431 Request Header Fields Too Large", "request head is too long")
_413 = _reply(b"413 Content Too Large", "request body too large")

class HeadLimitedHttpTools(BoundedHttpTools):
    """Refuses a request head over ``head_limit`` bytes: counted as parsed (request target
    and headers, for heads that arrive whole) and as received while the head is still
    incomplete (for heads that trickle in, which the parser buffers). Refuses a body over
    ``body_limit`` bytes, counted as it arrives, whatever its framing."""

    head_limit = MAX_REQUEST_BYTES
    body_limit = MAX_REQUEST_BYTES
    responder: Responder | None = None  # set on a server's own subclass

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._received = 0  # bytes read while this head was incomplete
        self._parsed = 0  # bytes of request target and headers parsed so far
        self._body = 0  # bytes of this request's body so far
        self._refused = False
        self._dropped = 0  # bytes dropped since the refusal
        self._refusal = _431  # the answer a refused request gets, if none was sent
        self._app_has_it = False  # this request's head went to the app
        self._fast: tuple[Answer, bool] | None = None  # answered here: (answer, keep-alive)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering: dropped
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES and self.transport is not None:
                self.transport.close()
            return
        if self._in_head:
            self._received += len(data)
        super().data_received(data)
        if self._refused or (self._in_head and self._received > self.head_limit):
            self._refused = True
            self._refuse()

    def _refuse(self) -> None:
        """Answer the refused request (unless the app did), then linger and close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        # (the cycle is this request's only once its head reached the app)
        cycle = self.cycle if self._app_has_it else None
        if cycle is None or not cycle.response_started:
            transport.write(self._refusal)
        if cycle is not None:
            cycle.disconnected = True  # the app's answer, if it comes, goes nowhere
        if transport.can_write_eof():  # plain TCP: the client sees the end at once
            transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, transport.close)

    def _count(self, n: int) -> bool:
        """Add ``n`` parsed bytes; False (and the request refused) once over the limit."""
        self._parsed += n
        if self._parsed > self.head_limit:
            self._refused = True
        return not self._refused

    def on_message_begin(self) -> None:
        self._in_head, self._received, self._parsed, self._body = True, 0, 0, 0
        self._app_has_it = False
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._count(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count(len(name) + len(value) + 4):
            if name.lower() == b"content-length" and not (
                    value.isdigit() and int(value) <= self.body_limit):
                # refused here rather than by the app: its answer would leave the
                # connection open for the body the client is still sending
                self._refused, self._refusal = True, _413
                return
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._refused:  # a refused request never reaches the app
            return
        cert = self.scope[PEER_CERT] = self._peer_cert()  # type: ignore[literal-required]
        idle = self.cycle is None or self.cycle.response_complete
        # While the client leaves answers unread (writes paused), the app answers: it
        # waits for them to be read first.
        if (self.responder is not None and idle and not self.flow.write_paused
                and not self.parser.should_upgrade()):
            answer = self.responder(self.parser.get_method(), self.url, self.headers, cert,
                                    self.client)
            if answer is not None:
                keep = (self.parser.get_http_version() != "1.0"
                        and self.parser.should_keep_alive())
                self._fast = (answer, keep)
                return
        super().on_headers_complete()
        self._app_has_it = True

    def _answer_here(self, answer: Answer, keep_alive: bool) -> None:
        """Write an answer of ``responder``'s and end the request as uvicorn's cycle does."""
        status, rest = answer
        parts = [status]
        for name, value in self.server_state.default_headers:
            parts += [name, b": ", value, b"\r\n"]
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(rest)
        self.transport.write(b"".join(parts))
        if keep_alive:
            self.on_response_complete()  # the keep-alive timer, the guard's idle state
        else:
            self.transport.close()

    def _peer_cert(self) -> dict | None:
        if not hasattr(self, "_cert"):
            ssl_object = None if self.transport is None else \
                self.transport.get_extra_info("ssl_object")
            self._cert = None if ssl_object is None else ssl_object.getpeercert()
        return self._cert

    def on_body(self, body: bytes) -> None:
        if self._refused or self._fast is not None:  # (responder answers no request with a body)
            return
        self._body += len(body)
        if self._body > self.body_limit:
            self._refused, self._refusal = True, _413
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        fast, self._fast = self._fast, None
        if self._refused:
            return
        if fast is not None:
            self._answer_here(*fast)
        else:
            super().on_message_complete()
