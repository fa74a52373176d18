"""Known peers stay warm: the http side-channel client's connection to a peer it fetched from
outlives an invalidation (a new handshake reuses it), a connection the peer closed is
replaced by one that resumes the TLS session, and keep-warm keeps it open past the peer's
keep-alive timeout. The client's deadline still bounds every one of those paths.

Real servers (``HttpHandshakeServer`` with trustme certificates) and real sockets.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvbridge.config import SideChannelConfig, TLSConfig
from kvbridge.errors import HandshakeTimeout
from kvbridge.handshake import make_client
from kvbridge.handshake.base import MetadataStore
from kvbridge.handshake.http.client import KEEP_WARM_PATH, HttpHandshakeClient
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.handshake.http.tls_sessions import tls_sessions
from kvbridge.kv_cache import allocate_kv_cache
from kvbridge.metadata import compat_of, encode_envelope
from kvbridge.peers import PeerManager
from kvbridge.settings.budget import ConnectionBudget
from kvbridge.tp_mapping import heads_per_rank
from kvbridge.transfer import NixlAgent
from tests.helpers import RawServer, compat, full_store, rank_meta, read_request, wait_until

HOST = "127.0.0.1"
TOKEN = "warm-" + "t" * 27
MARGIN = 3.0  # seconds: holds on a loaded 2-core machine


@pytest.fixture
def made() -> Iterator[list[HttpHandshakeClient]]:
    clients: list[HttpHandshakeClient] = []
    yield clients
    for c in clients:
        c.close()


def _client(made: list, tls: TLSConfig | None, timeout: float = 10.0,
            keep_warm: float | None = None) -> HttpHandshakeClient:
    c = HttpHandshakeClient(timeout, compat(), TOKEN, tls=tls, keep_warm=keep_warm)
    made.append(c)
    return c


@pytest.fixture
def short_keepalive_server(certs: Path) -> Iterator[HttpHandshakeServer]:
    """A TLS side channel that closes a connection idle for 0.3 s."""
    tls = TLSConfig(str(certs / "prefill.pem"), str(certs / "prefill.key"), str(certs / "ca.pem"))
    server = HttpHandshakeServer(full_store(2), HOST, 0, token=TOKEN, tls=tls,
                                 budget=ConnectionBudget(keep_alive_timeout=0.3))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _closed_by_peer(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_known_peer_reconnects_with_a_resumed_tls_session(short_keepalive_server, certs, made):
    port = short_keepalive_server.port
    client = _client(made, TLSConfig(ca_certs=str(certs / "ca.pem")))
    assert client.fetch(HOST, port, 0) == [rank_meta(0)]
    (first,) = client.idle_sockets(HOST, port)
    assert not first.session_reused  # a server never met: a full handshake
    # A second fetch (a new handshake after an invalidation) while the connection is open:
    # the same connection, no handshake at all.
    assert client.fetch(HOST, port, 1) == [rank_meta(1)]
    assert client.idle_sockets(HOST, port) == [first]
    wait_until(lambda: _closed_by_peer(first), 10, "the server closes the idle connection")
    assert client.fetch(HOST, port, 1) == [rank_meta(1)]
    (second,) = client.idle_sockets(HOST, port)
    assert second is not first and second.session_reused


def test_keep_warm_keeps_the_tls_connection_past_the_peers_keep_alive(short_keepalive_server,
                                                                      certs, made):
    """keep_warm 0.1 s against a server closing connections idle for 0.3 s: after several
    keep-alive periods the first connection is still the one used."""
    port = short_keepalive_server.port
    client = _client(made, TLSConfig(ca_certs=str(certs / "ca.pem")), keep_warm=0.1)
    assert client.fetch(HOST, port, 0) == [rank_meta(0)]
    (first,) = client.idle_sockets(HOST, port)
    assert client.known_peers() == [(HOST, port)]
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 > 1.2, 10, "four of the server's keep-alive periods")
    assert not _closed_by_peer(first)
    assert client.fetch(HOST, port, 1) == [rank_meta(1)]
    assert client.idle_sockets(HOST, port) == [first]
    before = _warmers()
    client.close()
    assert _warmers() == before - 1  # close stops (and joins) its keep-warm thread


def _warmers() -> int:
    return sum(t.name == "kvbridge-keep-warm" for t in threading.enumerate())


def test_keep_warm_sends_healthz_on_the_kept_connection(made):
    """A plain-http peer that closes a connection idle for 1 s: keep-warm (0.3 s) asks for
    /healthz on it often enough that it is never closed; one connection serves everything."""
    body = encode_envelope(compat(), [rank_meta(0)])
    accepted: list[socket.socket] = []
    paths: list[str] = []

    def handler(conn: socket.socket) -> None:
        accepted.append(conn)
        conn.settimeout(1.0)
        while True:
            try:
                head = read_request(conn)
            except TimeoutError:
                conn.close()  # idle for the keep-alive timeout
                return
            if not head:
                return
            path = head.split(b" ", 2)[1].decode()
            paths.append(path)
            answer = b'{"status":"ok"}' if path == KEEP_WARM_PATH else body
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(answer)
                         + answer)

    with RawServer(handler) as srv:
        client = _client(made, None, keep_warm=0.3)
        assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
        wait_until(lambda: paths.count(KEEP_WARM_PATH) >= 8, 20, "eight keep-warm requests")
        assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
        assert len(accepted) == 1
        client.close()
        n = len(paths)
        assert client.known_peers() == []
    assert len(paths) == n  # closed: no keep-warm request after close


def test_a_fetch_during_a_keep_warm_request_waits_for_its_connection(made):
    """A fetch that finds the peer's only connection out on a keep-warm request (here a
    slow one) waits for it to come back rather than paying a new connect."""
    body = encode_envelope(compat(), [rank_meta(0)])
    accepted: list[socket.socket] = []
    pinged = threading.Event()

    def handler(conn: socket.socket) -> None:
        accepted.append(conn)
        while head := read_request(conn):
            if head.split(b" ", 2)[1].decode() == KEEP_WARM_PATH:
                pinged.set()
                time.sleep(0.2)  # a slow peer, not synchronisation: the fetch waits for it
                answer = b'{"status":"ok"}'
            else:
                answer = body
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(answer)
                         + answer)

    with RawServer(handler) as srv:
        client = _client(made, None)
        assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
        warmed: list[bool] = []
        pinger = threading.Thread(target=lambda: warmed.append(client.warm(HOST, srv.port)))
        pinger.start()
        assert pinged.wait(10)
        assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
        pinger.join()
        assert warmed == [True]
        assert len(accepted) == 1


def _tls_server_context(certs: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs / "prefill.pem", certs / "prefill.key")
    return ctx


def test_deadline_bounds_a_known_peers_resumed_reconnect(certs, made):
    """The peer answers once over TLS (the client keeps its session), closes, and then
    accepts connections but never answers the TLS handshake: the known peer's next fetch
    and a keep-warm both end at the client's deadline."""
    ctx = _tls_server_context(certs)
    body = encode_envelope(compat(), [rank_meta(0)])
    first = threading.Event()

    def handler(conn: socket.socket) -> None:
        if first.is_set():  # stall: the watchdog must cut the TLS handshake
            conn.recv(1)
            return
        first.set()
        with ctx.wrap_socket(conn, server_side=True) as s:
            read_request(s)  # then closed: the client's kept connection ends
            s.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    tls = TLSConfig(ca_certs=str(certs / "ca.pem"))
    with RawServer(handler) as srv:
        client = _client(made, tls, timeout=0.5, keep_warm=60.0)
        assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
        assert client.known_peers() == [(HOST, srv.port)]
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            client.fetch(HOST, srv.port, 0)
        assert time.monotonic() - t0 < 0.5 + MARGIN
        # the kept connection, found closed, left its session for the reconnect to offer
        assert tls_sessions(tls).session(HOST, srv.port) is not None
        t0 = time.monotonic()
        assert client.warm(HOST, srv.port) is False
        assert time.monotonic() - t0 < 0.5 + MARGIN
        assert client.known_peers() == []  # a peer that does not answer is not kept warm


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_kept_connection_the_peer_closed_just_after_answering_is_replaced_once(
        made, certs, scheme):
    """A connection that answered a moment ago is reused without a look (no select); when
    the peer closed it all the same (one request per connection, no ``connection: close``
    said; over TLS without a close_notify), the fetch retries once on a new connection and
    succeeds."""
    body = encode_envelope(compat(), [rank_meta(0)])
    ctx = _tls_server_context(certs) if scheme == "https" else None
    connections = []

    def one_answer_then_close(conn: socket.socket) -> None:
        connections.append(conn)
        sock = conn if ctx is None else ctx.wrap_socket(conn, server_side=True)
        read_request(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # no close_notify on TLS

    tls = TLSConfig(ca_certs=str(certs / "ca.pem")) if scheme == "https" else None
    with RawServer(one_answer_then_close) as srv:
        client = _client(made, tls)
        for i in range(4):
            if i == 3:  # and once shut under the client itself: the request cannot be sent
                for sock in client.idle_sockets(HOST, srv.port):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
            assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
        assert len(connections) == 4


def test_keep_warm_must_be_positive():
    with pytest.raises(ValueError, match="keep_warm"):
        HttpHandshakeClient(1.0, compat(), keep_warm=0)


# --- the decode side: PeerManager handshakes again with a known peer -------------------------

def _kv_agent(tp: int) -> NixlAgent:
    agent = NixlAgent()
    agent.register_kv_cache(allocate_kv_cache(2, 4, heads_per_rank(tp, 4), 4, 8, torch.float32), 4)
    return agent


def test_handshake_again_after_an_epoch_change_reuses_the_warm_tls_connection(certs):
    """A prefill's epoch changes behind a side channel that stays up (its ranks publish new
    metadata): the decode's new handshake fetches over the connection its prewarm left, with
    no TLS handshake at all; once the server closed it while idle, the next one resumes."""
    prefill = [_kv_agent(2) for _ in range(2)]
    decode = _kv_agent(1)
    store = MetadataStore(compat_of("warm-test", prefill[0].kv), 2)
    tls = TLSConfig(str(certs / "prefill.pem"), str(certs / "prefill.key"), str(certs / "ca.pem"))
    server = HttpHandshakeServer(store, HOST, 0, token=TOKEN, tls=tls,
                                 budget=ConnectionBudget(keep_alive_timeout=2.0))
    client = HttpHandshakeClient(10.0, compat_of("warm-test", decode.kv), TOKEN,
                                 tls=TLSConfig(ca_certs=str(certs / "ca.pem")))
    mgr = PeerManager(decode, 0, 1, 4, lambda method: client)
    server.start()
    try:
        port = server.port
        for epoch in ("epoch-a", "epoch-b"):
            for r, a in enumerate(prefill):
                store.set_rank(a.rank_metadata("prefill-0", epoch, r, 2))
            assert mgr.connect("prefill-0", HOST, port, 2, method="http",
                               epoch=epoch).result(30).epoch == epoch
            socks = client.idle_sockets(HOST, port)
            if epoch == "epoch-a":
                first = set(socks)  # the prewarm's connections (two ranks, in parallel)
            else:
                assert set(socks) <= first  # the same verified connections, no new one
        wait_until(lambda: all(_closed_by_peer(s) for s in first), 10,
                   "the server closes the idle connections")
        mgr.invalidate("prefill-0")  # e.g. a failed READ
        assert mgr.connect("prefill-0", HOST, port, 2, method="http").result(30)
        socks = client.idle_sockets(HOST, port)
        assert socks and not set(socks) & first and all(s.session_reused for s in socks)
    finally:
        mgr.close()
        client.close()
        server.stop()
        for a in (*prefill, decode):
            a.close()


def test_make_client_keeps_warm_at_half_the_side_channel_keep_alive():
    cfg = SideChannelConfig.load({"handshake_method": "http",
                                  "side_channel_keep_alive_timeout": 12.0}, environ={})
    warm, plain = make_client(cfg, compat(), keep_warm=True), make_client(cfg, compat())
    assert isinstance(warm, HttpHandshakeClient) and warm.keep_warm == 6.0
    assert isinstance(plain, HttpHandshakeClient) and plain.keep_warm is None
    warm.close()
    plain.close()
