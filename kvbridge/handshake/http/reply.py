"""One HTTP/1.1 reply read off a socket, for the side channel's client: parsed by llhttp
(``httptools``, the parser under the side channel's server too), its head and body bounded.

Why not ``http.client``: its header parsing goes through the ``email`` package, three
quarters of a warm fetch's time on loopback. Here one parser
per reply, a handful of callbacks, and the reply's bytes read in as few ``recv`` calls as
they arrive in.

What a peer can send is bounded: a head of at most ``MAX_HEAD_BYTES``; a body of at most
the caller's limit, declared (``Content-Length``) or chunked, held in one buffer however
it is framed (at most about twice the limit in memory, the buffer and the bytes returned);
interim (1xx) replies, at most ``MAX_INTERIM`` of them. Anything llhttp refuses is a ``WireFormatError`` that quotes
its reason. A peer that closes before the first byte raises ``ClosedBeforeAnswer`` (an
idle keep-alive connection it closed: the caller may retry once on a new one).
"""

from __future__ import annotations

import socket

import httptools

from kvbridge.errors import WireFormatError

__all__ = ["MAX_HEAD_BYTES", "MAX_INTERIM", "ClosedBeforeAnswer", "read_reply"]

MAX_HEAD_BYTES = 16384  # the status line and headers of a reply (ours are under 200 bytes)
MAX_INTERIM = 4  # 1xx replies skipped before the real one
RECV_BYTES = 65536


class ClosedBeforeAnswer(ConnectionError):
    """The peer closed the connection before sending a byte of its reply."""


class _Reply:
    """llhttp's callbacks: what the reply said (interim replies skipped)."""

    parser: httptools.HttpResponseParser  # set once made (it is made with this object)

    def __init__(self, limit: int, url: str):
        self.limit, self.url = limit, url
        self.interim = 0
        self.done = False
        self.extra = False  # bytes after the reply: the connection cannot be used again
        self.keep = False
        self.status = 0
        self._new_message()

    def _new_message(self) -> None:
        self.length: int | None = None  # Content-Length, when declared
        self.chunked = False
        # One buffer the body is appended into: a bytes object kept per piece would cost
        # ~50 bytes each, 28x the body when a peer frames it in 2-byte chunks.
        self.body = bytearray()
        self.size = 0
        self.head_done = False

    def take_body(self) -> bytes:
        """The body as bytes (one copy: at most twice the body held at once), the
        buffer released."""
        body, self.body = bytes(self.body), bytearray()
        return body

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.done:
            return
        name = name.lower()
        if name == b"content-length":  # llhttp has checked it is one number
            self.length = int(value)
            if self.length > self.limit:
                raise WireFormatError(f"{self.url}: reply of {self.length} bytes exceeds the "
                                      f"limit of {self.limit}")
        elif name == b"transfer-encoding":
            self.chunked = b"chunked" in value.lower()

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if self.done:
            return
        self.size += len(body)
        if self.size > self.limit:
            raise WireFormatError(f"{self.url}: reply exceeds the limit of {self.limit} bytes")
        self.body += body

    def on_message_complete(self) -> None:
        if self.done:
            return
        status = self.parser.get_status_code()
        if status >= 200:
            self.done, self.status, self.keep = True, status, self.parser.should_keep_alive()
            return
        self.interim += 1
        if self.interim > MAX_INTERIM:
            raise WireFormatError(f"{self.url} answered more than {MAX_INTERIM} interim (1xx) "
                                  "replies")
        self._new_message()


def read_reply(sock: socket.socket, limit: int, url: str) -> tuple[int, bytes, bool]:
    """Read one reply to a request just sent on ``sock``: (status, body, whether the
    connection can carry another request). ``limit``: the largest body accepted."""
    reply = _Reply(limit, url)
    parser = reply.parser = httptools.HttpResponseParser(reply)
    fed = 0
    while not reply.done:
        data = sock.recv(RECV_BYTES)  # sized to what came (a zeroed buffer costs more)
        if not data:
            return _at_eof(reply, fed, url)
        fed += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # a 101: no answer to a GET of ours
            raise WireFormatError(f"{url} answered an upgrade to another protocol") from None
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, WireFormatError):  # a limit, raised in a callback
                raise e.__context__ from None
            if reply.done:  # garbage after a complete reply: the reply stands, not the link
                reply.extra = True
                break
            raise WireFormatError(f"{url} answered something that is not HTTP: {e}") from None
        if not reply.head_done and fed - reply.size > MAX_HEAD_BYTES * (1 + reply.interim):
            raise WireFormatError(f"{url}: reply head exceeds {MAX_HEAD_BYTES} bytes")
    return reply.status, reply.take_body(), reply.keep and not reply.extra


def _at_eof(reply: _Reply, fed: int, url: str) -> tuple[int, bytes, bool]:
    """The peer closed the connection before the reply was complete."""
    if fed == 0:
        raise ClosedBeforeAnswer("the peer closed the connection before answering")
    if not reply.head_done:
        raise WireFormatError(f"{url}: the connection closed in the reply's head")
    if reply.length is not None:
        raise WireFormatError(f"{url}: reply body ended {reply.length - reply.size} bytes short")
    if reply.chunked:
        raise WireFormatError(f"{url}: the connection closed in the reply's chunked body")
    return reply.parser.get_status_code(), reply.take_body(), False  # read to the close
