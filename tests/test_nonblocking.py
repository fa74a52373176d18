"""The side-channel client's reads and writes on non-blocking sockets
(kvbridge.handshake.nonblocking), over real socket pairs and real TLS (trustme): a reply
that comes after the spin is still read, a silent peer is a timeout, a send larger than
the socket's buffer goes out whole, and TLS records that arrive in pieces are read whole."""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbridge.handshake import nonblocking
from kvbridge.handshake.nonblocking import recv_some, send_all


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(ours, non-blocking; the peer's, blocking)."""
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    yield ours, peer
    ours.close()
    peer.close()


def test_a_reply_there_already_is_read_at_once(pair):
    ours, peer = pair
    peer.sendall(b"hello")
    assert recv_some(ours, 5) == b"hello"


def test_a_reply_after_the_spin_is_waited_for(pair, monkeypatch):
    """The peer writes only once our reader sleeps in select (past its spin)."""
    ours, peer = pair
    sleeping = threading.Event()
    real = select.select

    def watched(*args: object) -> object:
        sleeping.set()
        return real(*args)

    monkeypatch.setattr(nonblocking, "select", SimpleNamespace(select=watched))

    def later() -> None:
        assert sleeping.wait(5)
        peer.sendall(b"late")

    t = threading.Thread(target=later)
    t.start()
    assert recv_some(ours, 5) == b"late" and sleeping.is_set()
    t.join()


def test_a_silent_peer_is_a_timeout(pair):
    ours, _peer = pair
    with pytest.raises(TimeoutError):
        recv_some(ours, 0.05)


def test_end_of_file_is_empty(pair):
    ours, peer = pair
    peer.shutdown(socket.SHUT_WR)
    assert recv_some(ours, 5) == b""


def test_a_send_larger_than_the_buffer_goes_out_whole(pair):
    ours, peer = pair
    data = bytes(range(256)) * 40_000  # ~10 MB: many times a socket buffer
    got = bytearray()

    def read() -> None:
        while len(got) < len(data):
            got.extend(peer.recv(1 << 20))

    t = threading.Thread(target=read)
    t.start()
    send_all(ours, data, 5)
    t.join(30)
    assert bytes(got) == data


def test_a_send_the_peer_never_reads_is_a_timeout(pair):
    ours, _peer = pair
    with pytest.raises(TimeoutError):
        send_all(ours, b"x" * (64 << 20), 0.1)


def _relay(listener: socket.socket, upstream: int, piece: int) -> None:
    """Forward one connection to ``upstream``; what comes back, ``piece`` bytes at a time,
    a millisecond apart (longer than the reader's spin)."""
    down, _ = listener.accept()
    with down, socket.create_connection(("127.0.0.1", upstream)) as up:
        def forward() -> None:
            while data := down.recv(65536):
                up.sendall(data)
            up.shutdown(socket.SHUT_WR)

        threading.Thread(target=forward, daemon=True).start()
        while data := up.recv(65536):
            for i in range(0, len(data), piece):
                down.sendall(data[i:i + piece])
                time.sleep(0.001)  # shapes the traffic; no test outcome waits on it


def test_tls_records_in_pieces_are_read_whole(certs: Path):
    """A TLS peer whose records reach us a few bytes at a time: our non-blocking reads
    get SSLWantReadError until a record is whole, and the reply is read whole."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs / "prefill.pem", certs / "prefill.key")
    client_ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    server = socket.create_server(("127.0.0.1", 0))
    relay = socket.create_server(("127.0.0.1", 0))
    payload = b"kv metadata " * 100

    def serve() -> None:
        conn, _ = server.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            assert tls.recv(100) == b"GET"
            tls.sendall(payload)

    threads = [threading.Thread(target=serve),
               threading.Thread(target=_relay, args=(relay, server.getsockname()[1], 7))]
    for t in threads:
        t.start()
    with socket.create_connection(relay.getsockname(), timeout=5) as raw, \
            client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.setblocking(False)
        send_all(tls, b"GET", 5)
        got = bytearray()
        while len(got) < len(payload):
            got.extend(recv_some(tls, 5))
        assert bytes(got) == payload
    for t in threads:
        t.join(10)
    server.close()
    relay.close()
