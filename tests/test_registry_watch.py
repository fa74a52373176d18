"""A watch message that never ends (an etcd gateway, or what stands in for one, sending one
endless line): the registry client holds at most ``max_watch_message`` of it, then ends the
watch with a ``RegistryError``; the proxy's membership lists again, and its fleet view says
it is stale meanwhile. A fake gateway on a raw loopback socket."""

from __future__ import annotations

import base64
import json
import re
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import RegistryError
from kvbridge.proxy import build_proxy_app
from kvbridge.registry.etcd_client import MAX_WATCH_MESSAGE, EtcdEndpoint, EtcdRegistry
from kvbridge.registry.record import InstanceRecord, instance_key
from tests.helpers import RawServer, wait_until
from tests.raw_engine import read_request
from tests.test_proxy import Serve
from tests.test_proxy import serve as _serve

serve = _serve  # test_proxy's fixture: the proxy on a real uvicorn server

CAP = 64 * 1024
# What the gateway can push past the cap before it sees the close: socket buffers.
IN_FLIGHT = 48 << 20
RECORD = InstanceRecord(engine_id="p0", epoch="e", role="prefill", api_url="http://127.0.0.1:9",
                        tp_size=1, compat_hash="h")


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class Gateway(RawServer):
    """etcd's gateway as far as a reader of the fleet goes: ``ranges`` answers to
    ``/v3/kv/range`` (one record, then 503s), and every ``/v3/watch`` an endless line."""

    def __init__(self, ranges: int = 1) -> None:
        self.ranges = ranges
        self.sent = 0  # bytes of endless lines the sockets took
        self.watches_closed = threading.Event()
        self._lock = threading.Lock()
        super().__init__(self._serve)
        self.endpoint = EtcdEndpoint("127.0.0.1", self.port)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    head = read_request(conn)
                except EOFError:
                    return
                path = head.split(b" ")[1]
                if path == b"/v3/watch":
                    return self._endless(conn)
                with self._lock:
                    self.ranges -= 1
                    ok = self.ranges >= 0
                body = json.dumps({"header": {"revision": "5"}, "kvs": [
                    {"key": _b64(instance_key(RECORD)), "value": _b64(RECORD.encode()),
                     "mod_revision": "5"}]} if ok else {"error": "unavailable"}).encode()
                conn.sendall(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % (
                                 b"200 OK" if ok else b"503 Service Unavailable", len(body))
                             + body)

    def _endless(self, conn: socket.socket) -> None:
        chunk = b"A" * 65536
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            line = b'{"result":{"events":[{"kv":{"key":"'
            conn.sendall(b"%x\r\n%s\r\n" % (len(line), line))
            while True:  # a key that never ends: no newline, ever
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                with self._lock:
                    self.sent += len(chunk)
        except OSError:
            self.watches_closed.set()


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with Gateway() as g:
        yield g


def test_an_endless_watch_line_ends_the_watch_at_the_cap(gateway: Gateway) -> None:
    registry = EtcdRegistry(gateway.endpoint, max_watch_message=CAP)
    try:
        with pytest.raises(RegistryError, match=f"passed {CAP} bytes"):
            for _ in registry.watch_prefix("/kvbridge/", 6):
                pass
    finally:
        registry.close()
    assert gateway.watches_closed.wait(10)
    assert gateway.sent < CAP + IN_FLIGHT, gateway.sent


def test_a_value_of_the_largest_size_still_fits_the_cap(gateway: Gateway) -> None:
    """The cap is never below two values of ``max_value_bytes``: a watch of records that
    may be 1 MiB is not ended by a 64 KiB cap before one of them arrives."""
    registry = EtcdRegistry(gateway.endpoint, max_watch_message=CAP)
    try:
        with pytest.raises(RegistryError) as e:
            for _ in registry.watch_prefix("/kvbridge/", 6, max_value_bytes=1 << 20):
                pass
    finally:
        registry.close()
    cap = int(re.search(r"passed (\d+) bytes", str(e.value)).group(1))  # type: ignore[union-attr]
    assert cap >= 2 * len(_b64(b"x" * (1 << 20)))


def test_the_fleet_view_says_it_is_stale_after_an_endless_watch_line(serve: Serve) -> None:
    """Listed once, then the watch's endless line, then etcd refuses the list: the proxy
    routes on the last view, and /v1/fleet says so (was: ``connected: true`` while the
    watch buffered without end)."""
    with Gateway(ranges=1) as gateway:
        app = build_proxy_app([], [], registry=gateway.endpoint, prewarm=False,
                              admin_routes="open")
        with httpx.Client(base_url=serve(app), timeout=10, trust_env=False) as client:
            def stale() -> dict:
                registry = client.get("/v1/fleet").json()["registry"]
                return registry if registry["stale"] and registry["last_error"] else {}

            registry = wait_until(stale, 30, "the fleet view to say it is stale")
            fleet = client.get("/v1/fleet").json()
        assert registry["connected"] is False and registry["stale_seconds"] >= 0
        assert f"passed {MAX_WATCH_MESSAGE} bytes" in registry["last_error"]
        assert [p["url"] for p in fleet["prefill"]] == [RECORD.api_url]  # the last view
        assert gateway.watches_closed.wait(10)


PUT = json.dumps({"result": {"events": [{"kv": {
    "key": _b64("/kvbridge/a"), "value": _b64("v"), "mod_revision": "7"}}]}}).encode()


@settings(max_examples=50, deadline=None)
@given(messages=st.lists(st.one_of(st.just(PUT), st.binary(max_size=700)), max_size=6),
       splits=st.lists(st.integers(1, 64), max_size=8))
def test_a_watch_stream_in_any_pieces_is_read_or_refused(messages: list[bytes],
                                                         splits: list[int]) -> None:
    """Lines of anything (watch messages, bytes, lines past the cap), cut anywhere across
    reads: the events of the lines before the first bad one, then a ``RegistryError``
    at the latest when the stream ends."""
    stream = b"\n".join(messages)
    pieces, at = [], 0
    for n in splits:
        pieces.append(stream[at:at + n])
        at += n
    pieces.append(stream[at:])

    class Reply:  # http.client's response, as far as the reader uses it
        status = 200

        def __init__(self) -> None:
            self.parts = [p for p in pieces if p]

        def read1(self, n: int) -> bytes:
            return self.parts.pop(0) if self.parts else b""

    good = 0
    for m in messages:
        if m != PUT:
            break
        good += 1
    seen = 0
    try:
        for ev in EtcdRegistry._read_stream(Reply(), 1000, 512):  # type: ignore[arg-type]
            assert (ev.kind, ev.key, ev.value, ev.revision) == ("put", "/kvbridge/a", b"v", 7)
            seen += 1
    except RegistryError:
        pass
    assert seen >= good
