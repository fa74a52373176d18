"""A client that pipelines requests and never reads the answers holds a bounded part of a
server: the real side-channel process (plain http and https), raw sockets on loopback.

The side channel answers ``/healthz`` and handshakes in its protocol layer
(kvbridge.handshake.http.fast_path); those answers were written whatever the client read, and
reading went on: one such client grew the process by hundreds of MiB. Now reading stops
once 64 KiB of answers wait unread (kvbridge.bounded_http): the client's sends block, the
process's memory stays put, and other clients are served meanwhile.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvbridge.config import SideChannelConfig
from kvbridge.handshake import MetadataStore, make_client, side_channel
from kvbridge.handshake.process.parent import SideChannelProcess
from kvbridge.tools.testing.procfs import instance_rss_mib
from tests.helpers import compat, rank_meta

# Sent per flooding connection at most: a server that never stops reading takes it all.
CAP = 12 << 20
# A send that stays blocked this long: the server stopped reading (it never reads again).
BLOCKED = 2.0
# What the flood may add to the process's RSS (before the fix: hundreds of MiB).
GROWTH_MIB = 32


def _config(**kw: object) -> SideChannelConfig:
    return SideChannelConfig.load({"handshake_method": "http", "side_channel_host": "127.0.0.1",
                                   "side_channel_port": 0, **kw}, {})


def _store() -> MetadataStore:
    """Two ranks with 8 KiB of agent metadata each, as NIXL's are: a handshake's answer is
    about 16 KiB."""
    store = MetadataStore(compat(), 2)
    for r in range(2):
        store.set_rank(rank_meta(r, 2, agent_metadata=bytes(8192)))
    return store


@contextmanager
def _running(cfg: SideChannelConfig) -> Iterator[SideChannelProcess]:
    server = side_channel(cfg, _store())
    assert isinstance(server, SideChannelProcess)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _connect(port: int, tls: ssl.SSLContext | None) -> socket.socket:
    raw = socket.socket()
    # The client reads nothing: small buffers, so the server's writes are what fill up.
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    raw.connect(("127.0.0.1", port))
    sock = raw if tls is None else tls.wrap_socket(raw, server_hostname="127.0.0.1")
    sock.setblocking(False)
    return sock


def _flood(sock: socket.socket, target: str) -> int:
    """Pipeline ``GET target`` on ``sock`` without reading, until a send stays blocked for
    ``BLOCKED`` seconds or ``CAP`` bytes went; the bytes sent."""
    batch = f"GET {target} HTTP/1.1\r\nhost: side-channel\r\n\r\n".encode() * 1000
    sent = 0
    while sent < CAP:
        try:
            sent += sock.send(memoryview(batch)[sent % len(batch):])
        except (BlockingIOError, ssl.SSLWantWriteError):
            if not select.select([], [sock], [], BLOCKED)[1]:
                break
    return sent


def _legitimate_fetch(cfg: SideChannelConfig, port: int) -> list[int]:
    client = make_client(cfg, compat())
    try:
        return [r.tp_rank for r in client.fetch("127.0.0.1", port)]
    finally:
        client.close()


def test_pipelined_requests_never_read_stop_being_read_and_memory_stays_put() -> None:
    cfg = _config()
    with _running(cfg) as server:
        assert _legitimate_fetch(cfg, server.port) == [0, 1]  # warm: the app and fast path
        before = instance_rss_mib(server.pid)
        floods = [_connect(server.port, None) for _ in range(2)]
        try:
            sent = [_flood(floods[0], "/healthz"), _flood(floods[1], "/v1/kv/handshake")]
            grown = instance_rss_mib(server.pid) - before
            print(f"http: {[s >> 10 for s in sent]} KiB taken, RSS {before:.0f} MiB + {grown:.0f}")
            assert max(sent) < CAP, f"the server kept reading: {sent} bytes, +{grown:.0f} MiB"
            assert grown < GROWTH_MIB, f"the side channel grew {grown:.0f} MiB"
            # served meanwhile, the flooders still connected
            assert _legitimate_fetch(cfg, server.port) == [0, 1]
        finally:
            for s in floods:
                s.close()
        assert _legitimate_fetch(cfg, server.port) == [0, 1]


def test_over_tls_too(certs: Path) -> None:
    cfg = _config(ssl_certfile=str(certs / "prefill.pem"), ssl_keyfile=str(certs / "prefill.key"))
    tls = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    client_cfg = _config(ssl_ca_certs=str(certs / "ca.pem"))
    with _running(cfg) as server:
        assert _legitimate_fetch(client_cfg, server.port) == [0, 1]
        before = instance_rss_mib(server.pid)
        flood = _connect(server.port, tls)
        try:
            sent = _flood(flood, "/healthz")
            grown = instance_rss_mib(server.pid) - before
            print(f"https: {sent >> 10} KiB taken, RSS {before:.0f} MiB + {grown:.0f}")
            assert sent < CAP, f"the server kept reading: {sent} bytes, +{grown:.0f} MiB"
            assert grown < GROWTH_MIB, f"the side channel grew {grown:.0f} MiB"
            assert _legitimate_fetch(client_cfg, server.port) == [0, 1]
        finally:
            flood.close()
