"""The side-channel server's HTTP/1.1 protocol: every server's (``kvbridge.bounded_http``:
a cap on the request head, reading bounded by unread answers) with the side channel's own
head limit (16 KiB, ``MAX_REQUEST_BYTES``), a cap on the request body, and a fast path.

A body is counted as it streams: a chunked one declares no length for the app to refuse
up front, and uvicorn discards what an answered request still sends, for as long as the
client sends it. Past the limit the request is answered 413 (unless the app already
answered) and the connection closed after the linger.

A request ``responder`` can answer (``kvbridge.handshake.http.fast_path``: a handshake, the
probes) is answered here, from the parsed head, without an ASGI task; any other goes to the
app. Requests answered in order: one waits behind an app request still running
on its connection (HTTP pipelining) by going to the app too. So does one that arrives
while writes are paused (the client has not read 64 KiB of answers): the app's answer
waits until they are read, and reading stops meanwhile, so a client that pipelines
requests and never reads the answers holds at most that much.
"""

from __future__ import annotations

from kvbridge.bounded_http import BoundedHttpTools, refusal
from kvbridge.guard import PEER_CERT
from kvbridge.handshake.base import MAX_REQUEST_BYTES
from kvbridge.handshake.http.fast_path import Answer, Responder

__all__ = ["PEER_CERT", "HeadLimitedHttpTools"]

_413 = refusal(b"413 Content Too Large", "request body too large")


class HeadLimitedHttpTools(BoundedHttpTools):
    """Refuses a request head over ``head_limit`` bytes (at most ``MAX_REQUEST_BYTES``; the
    base counts it) and a body over ``body_limit`` bytes, counted as it arrives, whatever
    its framing; answers what ``responder`` can from the head."""

    head_limit = head_ceiling = MAX_REQUEST_BYTES
    body_limit = MAX_REQUEST_BYTES
    responder: Responder | None = None  # set on a server's own subclass

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._body = 0  # bytes of this request's body so far
        self._fast: tuple[Answer, bool] | None = None  # answered here: (answer, keep-alive)

    def on_message_begin(self) -> None:
        self._body = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        if not self._refused and name.lower() == b"content-length" and not (
                value.isdigit() and int(value) <= self.body_limit):
            # refused here rather than by the app: its answer would leave the connection
            # open for the body the client is still sending
            self._refused, self._refusal = True, _413

    def on_headers_complete(self) -> None:
        if self._refused:
            super().on_headers_complete()  # (never reaches the app)
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
                self._in_head = False
                keep = (self.parser.get_http_version() != "1.0"
                        and self.parser.should_keep_alive())
                self._fast = (answer, keep)
                return
        super().on_headers_complete()

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
