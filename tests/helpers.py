"""Small builders and raw socket servers shared by the side-channel tests."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

from kvbridge.handshake.base import MetadataStore, Reply
from kvbridge.metadata import Compat, KVLayout, RankMetadata, compat_of
from kvbridge.tools.testing.wait import wait_until  # noqa: F401 (the one polling helper, re-exported)

MODEL = "test-model"
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 8, 4, 4, 16


def layout(tp_size: int = 2, *, dtype: str = "float16", head_dim: int = HEAD_DIM,
           num_layers: int = LAYERS, total_kv_heads: int = HEADS, base: int = 0x7F00_0000_0000,
           **override) -> KVLayout:
    heads = max(1, total_kv_heads // tp_size)
    itemsize = 4 if dtype == "float32" else 2
    block_len = heads * BLOCK_SIZE * head_dim * itemsize
    region = BLOCKS * block_len
    fields = dict(num_layers=num_layers, num_blocks=BLOCKS, block_size=BLOCK_SIZE,
                  total_kv_heads=total_kv_heads, kv_heads_per_rank=heads, head_dim=head_dim,
                  dtype=dtype, layout="HND",
                  base_addrs=[base + i * region for i in range(2 * num_layers)],
                  block_len=block_len)
    fields.update(override)
    return KVLayout(**fields)


def rank_meta(tp_rank: int, tp_size: int = 2, *, engine_id: str = "prefill-0",
              epoch: str = "epoch-a", agent_metadata: bytes | None = None,
              kv: KVLayout | None = None, **kv_override) -> RankMetadata:
    kv = kv or layout(tp_size, base=0x7F00_0000_0000 + tp_rank * 0x10_0000_0000, **kv_override)
    return RankMetadata(
        engine_id=engine_id, epoch=epoch, tp_rank=tp_rank, tp_size=tp_size,
        agent_name=f"agent-{engine_id}-{epoch}-r{tp_rank}",
        agent_metadata=(agent_metadata if agent_metadata is not None
                        else b"NIXLMD" + bytes([tp_rank]) * 58),
        kv=kv, tags_addr=0x7E00_0000_0000 + tp_rank * 0x1_0000)


def compat(**kv_override) -> Compat:
    return compat_of(MODEL, layout(**kv_override))


def full_store(tp_size: int = 2, **kw) -> MetadataStore:
    store = CountingStore(compat(), tp_size)
    for r in range(tp_size):
        store.set_rank(rank_meta(r, tp_size, **kw))
    return store


class CountingStore(MetadataStore):
    """A real MetadataStore that counts the requests the server answered from it."""

    def __init__(self, compat: Compat, tp_size: int):
        super().__init__(compat, tp_size)
        self.requests: list[int | None] = []
        self._count_lock = threading.Lock()

    def reply(self, tp_rank: int | None) -> Reply:
        with self._count_lock:
            self.requests.append(tp_rank)
        return super().reply(tp_rank)


def refused_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class RawServer:
    """A TCP server on 127.0.0.1:0 running ``handler(conn)`` for every connection.

    ``handler`` None: listen only, never accept (connections wait in the backlog).
    """

    def __init__(self, handler: Callable[[socket.socket], None] | None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        self.stopped = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread: threading.Thread | None = None
        if handler is not None:
            self._thread = threading.Thread(target=self._accept, daemon=True)
            self._thread.start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.handler(conn)
        except OSError:
            pass

    def close(self) -> None:
        self.stopped.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in self._conns:
            c.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_request(conn: socket.socket) -> bytes:
    """Read one HTTP request head (the handshake requests have no body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data



class RogueSideChannel(RawServer):
    """An attacker's side channel on 127.0.0.1 (TLS with ``certfile``/``keyfile``): it
    records every connection and the ``Authorization`` header of every request, and
    answers 404."""

    def __init__(self, certfile: Path | None = None, keyfile: Path | None = None):
        self.connections = 0
        self.authorizations: list[str] = []
        self._ctx = None
        if certfile is not None:
            self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._ctx.load_cert_chain(str(certfile), str(keyfile))
        super().__init__(self._serve)

    def _serve(self, conn: socket.socket) -> None:
        self.connections += 1
        conn.settimeout(10)
        if self._ctx is not None:
            try:
                conn = self._ctx.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError):  # a client that does not trust the certificate
                return
        with conn:
            head = read_request(conn).decode("latin-1")
            self.authorizations += [line.split(":", 1)[1].strip()
                                    for line in head.split("\r\n")
                                    if line.lower().startswith("authorization:")]
            conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n"
                         b"connection: close\r\n\r\n")
