"""The side channel's http client holds a reply's body in memory at most about twice,
however a peer frames it: 2-byte chunks (``Transfer-Encoding: chunked``) or a declared
length, each piece its own TCP write (its own TLS record over TLS), from a real server in
a process of its own. Measured with tracemalloc over one fetch of a max-size reply."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.config import TLSConfig
from kvbridge.handshake.http.client import HttpHandshakeClient

SERVER = str(Path(__file__).resolve().parent / "tiny_chunks_server.py")
SIZE = 256 * 1024  # the reply's body, and the client's max_message_bytes
# The buffer the body is read into (its growth slack an eighth) and the bytes returned,
# plus two 64 KiB recv buffers and a TLS connection's state: measured 2.1-2.6x. A bytes
# object kept per piece measured 6-63x.
BOUND = 3 * SIZE


@pytest.fixture(params=["plain", "tls"])
def scheme(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["chunked", "length"])
def server(request: pytest.FixtureRequest, scheme: str, certs: Path) -> Iterator[int]:
    tls = ["--certfile", str(certs / "prefill.pem"),
           "--keyfile", str(certs / "prefill.key")] if scheme == "tls" else []
    proc = subprocess.Popen([sys.executable, SERVER, "--size", str(SIZE),
                             "--framing", request.param, *tls], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the server died: exit {proc.wait()}"
        yield int(line)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_max_size_reply_in_tiny_pieces_costs_at_most_twice_its_size(
        server: int, scheme: str, certs: Path) -> None:
    tls = TLSConfig(ca_certs=str(certs / "ca.pem")) if scheme == "tls" else None
    client = HttpHandshakeClient(60.0, None, max_message_bytes=SIZE, tls=tls)
    try:
        tracemalloc.start()
        try:
            body = client.fetch_body("127.0.0.1", server)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        client.close()
    assert body == bytes(i % 251 for i in range(SIZE))
    assert peak < BOUND, f"peak {peak / SIZE:.1f}x the body"
