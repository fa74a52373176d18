"""The side-channel server's HTTP/1.1 protocol: uvicorn's httptools one with a cap on the
request head.

httptools (llhttp) parses faster than h11 but, unlike uvicorn's h11 protocol with
``h11_max_incomplete_event_size``, has no limit on how large a head may grow. Requests of
the side channel carry a path, a token and a few headers: a head over the limit is
answered 431 and the connection closed, whether it came in one read or trickled in.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvbridge.errors import error_body
from kvbridge.guard import PEER_CERT
from kvbridge.handshake.base import MAX_REQUEST_BYTES


def _reply_431() -> bytes:
    body = json.dumps(error_body("request head is too long", "invalid_request_error")).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body


_431 = _reply_431()

class HeadLimitedHttpTools(HttpToolsProtocol):
    """Refuses a request head over ``head_limit`` bytes: counted as parsed (request target
    and headers, for heads that arrive whole) and as received while the head is still
    incomplete (for heads that trickle in, which the parser buffers)."""

    head_limit = MAX_REQUEST_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._received = 0  # bytes read while this head was incomplete
        self._parsed = 0  # bytes of request target and headers parsed so far
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._received += len(data)
        super().data_received(data)
        if self._refused or (self._in_head and self._received > self.head_limit):
            self._refused = True
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(_431)
                self.transport.close()

    def _count(self, n: int) -> bool:
        """Add ``n`` parsed bytes; False (and the request refused) once over the limit."""
        self._parsed += n
        if self._parsed > self.head_limit:
            self._refused = True
        return not self._refused

    def on_message_begin(self) -> None:
        self._in_head, self._received, self._parsed = True, 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._count(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count(len(name) + len(value) + 4):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if not self._refused:  # a refused request never reaches the app
            self.scope[PEER_CERT] = self._peer_cert()  # type: ignore[literal-required]
            super().on_headers_complete()

    def _peer_cert(self) -> dict | None:
        if not hasattr(self, "_cert"):
            ssl_object = None if self.transport is None else \
                self.transport.get_extra_info("ssl_object")
            self._cert = None if ssl_object is None else ssl_object.getpeercert()
        return self._cert

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()
