"""The side channel client's reply reader (``kvbridge.handshake.http.reply``) on a real
socket pair: what a peer may send, what it may not, and when the connection can be used
again."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import HandshakeError, WireFormatError
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.reply import (
    MAX_HEAD_BYTES,
    MAX_INTERIM,
    ClosedBeforeAnswer,
    read_reply,
)

URL = "http://peer:1"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"


@contextmanager
def peer(*pieces: bytes, close: bool = True) -> Iterator[socket.socket]:
    """Our end of a socket pair whose other end sends ``pieces`` one by one (then closes)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def send() -> None:
        for piece in pieces:
            theirs.sendall(piece)
        if close:
            theirs.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        yield ours
    finally:
        sender.join()
        ours.close()
        theirs.close()


def test_a_reply_with_a_length_keeps_the_connection() -> None:
    with peer(OK, close=False) as sock:
        assert read_reply(sock, 100, URL) == (200, b"hello", True)


def test_a_reply_in_pieces_is_put_together() -> None:
    with peer(*(OK[i:i + 3] for i in range(0, len(OK), 3)), close=False) as sock:
        assert read_reply(sock, 100, URL) == (200, b"hello", True)


def test_two_replies_on_one_connection_are_read_one_at_a_time() -> None:
    second = b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\nno"
    with peer(OK, close=False) as sock:
        assert read_reply(sock, 100, URL) == (200, b"hello", True)
    with peer(second, close=False) as sock:
        assert read_reply(sock, 100, URL) == (404, b"no", True)


def test_connection_close_is_honoured() -> None:
    reply = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    with peer(reply, close=False) as sock:
        assert read_reply(sock, 100, URL) == (200, b"ok", False)


def test_a_chunked_reply_is_read_whole() -> None:
    reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"
    with peer(reply, close=False) as sock:
        assert read_reply(sock, 100, URL) == (200, b"hello", True)


def test_a_body_without_a_length_is_read_to_the_close_and_not_reused() -> None:
    with peer(b"HTTP/1.1 200 OK\r\n\r\nhello") as sock:
        assert read_reply(sock, 100, URL) == (200, b"hello", False)


def test_interim_replies_are_skipped_up_to_a_bound() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    with peer(interim * MAX_INTERIM + OK, close=False) as sock:
        assert read_reply(sock, 100, URL) == (200, b"hello", True)
    with peer(interim * (MAX_INTERIM + 1) + OK) as sock, \
            pytest.raises(WireFormatError, match="interim"):
        read_reply(sock, 100, URL)


def test_bytes_after_the_reply_leave_the_connection_unusable() -> None:
    for extra in (OK, b"garbage"):
        with peer(OK + extra, close=False) as sock:
            assert read_reply(sock, 100, URL) == (200, b"hello", False)


@pytest.mark.parametrize("reply, match", [
    (b"SSH-2.0-OpenSSH_9.6\r\n", "not HTTP"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello", "not HTTP"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "not HTTP"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\n", "not HTTP"),
    (b"HTTP/1.1 200 OK\r\nx-folded: a\r\n b\r\n\r\n", "not HTTP"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n", "exceeds the limit of 100"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + (b"10\r\n" + b"x" * 16 + b"\r\n") * 8,
     "exceeds the limit of 100"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort", "ended 45 bytes short"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel", "chunked body"),
    (b"HTTP/1.1 200 OK\r\ncontent-len", "in the reply's head"),
    (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
     "upgrade"),
], ids=["ssh", "two-lengths", "negative-length", "huge-length", "folded-header", "declared-big",
        "chunked-big", "short", "chunked-cut", "head-cut", "upgrade"])
def test_what_a_peer_may_not_send_is_a_wire_format_error(reply: bytes, match: str) -> None:
    with peer(reply) as sock, pytest.raises(WireFormatError, match=match):
        read_reply(sock, 100, URL)


def test_a_head_that_never_ends_is_refused_at_its_bound() -> None:
    endless = b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"p" * (2 * MAX_HEAD_BYTES)
    with peer(endless) as sock, pytest.raises(WireFormatError, match="head exceeds"):
        read_reply(sock, 100, URL)


def test_a_close_before_any_byte_is_its_own_error() -> None:
    """(What the client retries once, on a new connection, after an idle one was closed.)"""
    with peer() as sock, pytest.raises(ClosedBeforeAnswer):
        read_reply(sock, 100, URL)


@pytest.mark.parametrize("token", ["a\r\nx-injected: 1", "nul\x00", "tab\x7f"])
def test_a_token_that_would_inject_a_header_is_never_sent(token: str) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def record() -> None:
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(4096):
                received.append(chunk)

    reader = threading.Thread(target=record)
    reader.start()
    client = HttpHandshakeClient(5.0, None, token)
    try:
        with pytest.raises(HandshakeError, match="HTTP header"):
            client.fetch_body("127.0.0.1", listener.getsockname()[1], 0)
    finally:
        client.close()
        reader.join(5)
        listener.close()
    assert received == []  # the connection was made, and nothing written on it


# --- fuzz: whatever a peer sends, a reply within bounds or a WireFormatError -----------

VALID = (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\ncontent-length: 5\r\n"
         b"\r\nhello")
CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from([VALID, CHUNKED, OK])))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
        if kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:at + draw(st.integers(1, 8))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data[at:at] = data[max(0, at - 8):at] * draw(st.integers(1, 50))
    return bytes(data)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.one_of(mutated(), st.binary(max_size=300)))
def test_fuzzed_replies_are_read_within_bounds_or_refused(reply: bytes) -> None:
    with peer(reply) as sock:
        try:
            status, body, _ = read_reply(sock, 100, URL)
        except (WireFormatError, ClosedBeforeAnswer):
            return
    assert 200 <= status <= 999
    assert len(body) <= 100
