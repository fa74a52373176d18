"""A raw-socket HTTP/1.1 engine on loopback that misbehaves on purpose, at the one request a
test names: the proxy's transport is tested against each way an engine can close, reset,
trickle or flood, provoked in order on the socket rather than left to timing.

Every other request is answered like a prefill (a small JSON 200), and the connection is
kept alive, so the request a test names can be the second one of a reused connection.
"""

from __future__ import annotations

import itertools
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

from tests.helpers import RawServer

__all__ = ["ANSWER", "Misbehaviour", "RawEngine", "read_head", "read_request"]

ANSWER = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": None}).encode()
Misbehaviour = Callable[[socket.socket], None]


def read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    """(a request's head, the bytes read past it); raises EOFError at an end of stream."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise EOFError
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def read_request(conn: socket.socket) -> bytes:
    """One whole request (head and a content-length body); its head returned."""
    head, rest = read_head(conn)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(min(1 << 20, length - len(rest)))
        if not chunk:
            raise EOFError
        rest += chunk
    return head


def answer(conn: socket.socket, body: bytes = ANSWER) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)


def reset(conn: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), whatever the buffers hold."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _drain(conn: socket.socket) -> None:
    """Read until the client closes (so nothing unread turns our close into an RST)."""
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


# -- what an engine may do at the named request --------------------------------------------

def close_before_head(conn: socket.socket) -> None:
    """The request has begun to arrive: closed without reading a byte of it (an idle
    connection's keep-alive timer ran out as it came; unread bytes make the close an RST)."""
    conn.recv(1, socket.MSG_PEEK)
    reset(conn)


def close_in_body(conn: socket.socket) -> None:
    """The head read, closed while the client still writes a body larger than the
    buffers between them (a client's send buffer is at most net.ipv4.tcp_wmem's last
    figure, 4 MiB by default; a receive buffer nobody reads does not grow): its write
    fails."""
    read_head(conn)
    reset(conn)


def reset_unanswered(conn: socket.socket) -> None:
    """The whole request read, then an RST, not a byte of answer."""
    read_request(conn)
    reset(conn)


def eof_before_status(conn: socket.socket) -> None:
    """The whole request read, then an orderly close (FIN) before the status line."""
    read_request(conn)
    conn.shutdown(socket.SHUT_WR)
    _drain(conn)


# What a client must not send again: the engine took the request.

def half_status_line(conn: socket.socket) -> None:
    """Part of a status line, then a close: the engine had begun its answer."""
    read_request(conn)
    conn.sendall(b"HTTP/1.1 2")
    conn.shutdown(socket.SHUT_WR)
    _drain(conn)


def cut_in_body(conn: socket.socket) -> None:
    """A head and part of its body, then a close."""
    read_request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial")
    conn.shutdown(socket.SHUT_WR)
    _drain(conn)


def silent(conn: socket.socket) -> None:
    """The request read, never answered (an engine still at work) until the client goes."""
    read_request(conn)
    _drain(conn)


class Endless:
    """An answer whose body never ends (``status``; chunked), sent until the client closes
    the connection; ``sent``: the body's bytes the socket took."""

    CHUNK = b"x" * 65536

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.sent = 0
        self.closed = threading.Event()

    def __call__(self, conn: socket.socket) -> None:
        read_request(conn)
        try:
            conn.sendall(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n" % self.status)
            while True:
                conn.sendall(b"%x\r\n%s\r\n" % (len(self.CHUNK), self.CHUNK))
                self.sent += len(self.CHUNK)
        except OSError:
            self.closed.set()  # the client closed the connection


class Trickle:
    """An answer sent one byte every ``period`` seconds, its head included: each read of
    the client gets a byte within any read timeout longer than the period, and the whole
    answer (a megabyte) would take days. Until the client closes (``closed`` set then)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.closed = threading.Event()

    def __call__(self, conn: socket.socket) -> None:
        read_request(conn)
        answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000000\r\n\r\n" + b" " * 1000000)
        try:
            for i in range(len(answer)):
                conn.sendall(answer[i:i + 1])
                time.sleep(self.period)  # the engine's own pace
        except OSError:
            self.closed.set()  # the client closed the connection


class RawEngine(RawServer):
    """Answers every request, keeping connections alive, except request ``at`` =
    (connection, request on it), both counted from 0, where it calls ``misbehave`` and
    closes that connection. ``connections``: accepted; ``answered``: requests answered."""

    def __init__(self, misbehave: Misbehaviour, at: tuple[int, int] = (0, 1),
                 body: bytes = ANSWER) -> None:
        self.misbehave, self.at, self.body = misbehave, at, body
        self.connections = 0
        self.answered = 0
        self.misbehaved = threading.Event()
        self._lock = threading.Lock()
        super().__init__(self._serve)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            index = self.connections
            self.connections += 1
        with conn:
            for request in itertools.count():
                if (index, request) == self.at:
                    self.misbehave(conn)
                    self.misbehaved.set()
                    return
                try:
                    read_request(conn)
                except EOFError:
                    return
                with self._lock:  # counted before the client can see the answer
                    self.answered += 1
                answer(conn, self.body)

