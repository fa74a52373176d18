"""Every kvbridge server caps a request head, in bytes and in header lines, counted as it
arrives (kvbridge.bounded_http, the budget's ``max_head_bytes`` and ``max_headers``): a real
``kvbridge serve`` (engine API and its side-channel process) and a real ``kvbridge proxy``,
raw sockets on loopback; then a property test of the cap on an in-process server.

Before, the engine API and the proxy read heads without a bound: 24 MiB of tiny header
lines grew each by about 400 MiB, and one endless header line was parsed in quadratic time
until the head deadline.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from kvbridge.bounded_http import BoundedHttpTools
from kvbridge.errors import ConfigError
from kvbridge.guard import ConnectionBudget, guarded_config, guarded_protocol
from kvbridge.handshake.base import MAX_REQUEST_BYTES
from kvbridge.handshake.http.protocol import HeadLimitedHttpTools
from kvbridge.tools.launch import KVBridgeProcess, free_port
from kvbridge.tools.testing.api_server import BackgroundServer
from kvbridge.tools.testing.procfs import children, instance_rss_mib
from tests.conftest import ROOT

HOST = "127.0.0.1"
START_TIMEOUT = 180.0
CAP = 24 << 20  # bytes of head sent at most: a server without a cap takes them all
TAKEN = 8 << 20  # a capped server stops reading long before (socket buffers hold the rest)
GROWTH_MIB = 32  # what one oversized head may add to a server's RSS (before: ~400 MiB)
HEAD_TIMEOUT = ConnectionBudget().head_timeout  # refused before it: counted, not timed out


class _Instance:
    """A ``kvbridge serve --role both`` (tiny model, http side channel) and a ``kvbridge
    proxy`` in front of it."""

    def __init__(self, log_dir: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.api_port, self.proxy_port = free_port(), free_port()
        api = f"http://{HOST}:{self.api_port}"
        self.serve = KVBridgeProcess("heads-serve", log_dir, "serve", "--port",
                                     str(self.api_port), "--dtype", "float64", "--role", "both",
                                     "--handshake", "http", "--side-channel-port", "0", env=env)
        self.proxy = KVBridgeProcess("heads-proxy", log_dir, "proxy", "--prefill", api,
                                     "--decode", api, "--port", str(self.proxy_port), env=env)

    def start(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        self.serve.wait_healthy(f"http://{HOST}:{self.api_port}/health", deadline)
        self.proxy.wait_healthy(f"http://{HOST}:{self.proxy_port}/health", deadline)
        info = httpx.get(f"http://{HOST}:{self.api_port}/v1/kv/info", timeout=10).json()
        self.side_port = info["side_channel_port"]
        (self.side_pid,) = children(self.serve.proc.pid, "kvbridge.handshake.process.child")

    def stop(self) -> None:
        self.proxy.stop()
        self.serve.stop()

    def target(self, server: str) -> tuple[int, int, str]:
        """(port, pid, health path) of ``server``."""
        return {"engine API": (self.api_port, self.serve.proc.pid, "/health"),
                "proxy": (self.proxy_port, self.proxy.proc.pid, "/health"),
                "side channel": (self.side_port, self.side_pid, "/healthz")}[server]


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Instance]:
    inst = _Instance(tmp_path_factory.mktemp("heads"))
    try:
        inst.start()
        yield inst
    finally:
        inst.stop()


# What follows a request line: endless tiny header lines, one endless header line, or a
# head of a few hundred bytes with more header lines than the cap (100).
_KINDS = {
    "tiny lines": (b"", b"x: y\r\n" * 10_000),
    "one line": (b"x-long: ", b"a" * 65536),
    "many headers": (b"".join(b"h%d: v\r\n" % i for i in range(150)) + b"\r\n", b""),
}


def _send_head(port: int, kind: str) -> tuple[bytes, int, float]:
    """Send a GET whose head is ``kind`` until an answer comes, the server closes, or
    ``CAP`` bytes went: (what was answered, bytes sent, seconds to the end of the answer)."""
    first, more = _KINDS[kind]
    sock = socket.create_connection((HOST, port))
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: heads\r\n" + first)
        sock.setblocking(False)
        start, sent, reply = time.monotonic(), len(first), b""
        while True:
            wanted = [sock] if more and sent < CAP else []
            readable, writable, _ = select.select([sock], wanted, [], HEAD_TIMEOUT * 2)
            if readable:
                try:
                    chunk = sock.recv(65536)
                except ConnectionError:
                    chunk = b""
                if not chunk:
                    return reply, sent, time.monotonic() - start  # closed: the whole answer
                reply += chunk
            elif writable:
                try:
                    sent += sock.send(more)
                except BlockingIOError:
                    pass
                except ConnectionError:
                    return reply, sent, time.monotonic() - start
            else:
                return reply, sent, time.monotonic() - start  # neither: still open, silent
    finally:
        sock.close()


@pytest.mark.parametrize(("server", "kind"), [
    ("engine API", "tiny lines"), ("engine API", "one line"), ("engine API", "many headers"),
    ("proxy", "tiny lines"), ("proxy", "one line"), ("proxy", "many headers"),
    ("side channel", "many headers")])  # (its 16 KiB byte cap was there before)
def test_an_oversized_head_is_431_and_closed_and_the_server_goes_on(instance, server, kind):
    port, pid, health = instance.target(server)
    before = instance_rss_mib(pid)
    reply, sent, seconds = _send_head(port, kind)
    grown = instance_rss_mib(pid) - before
    print(f"{server}, {kind}: {reply[:12]!r} after {sent >> 10} KiB in {seconds:.2f} s, "
          f"RSS {before:.0f} MiB + {grown:.0f}")
    assert reply.startswith(b"HTTP/1.1 431 "), (reply[:100], sent, seconds)
    assert seconds < HEAD_TIMEOUT  # refused as counted, closed: not at the head deadline
    assert sent < TAKEN and grown < GROWTH_MIB, (sent, grown)
    assert httpx.get(f"http://{HOST}:{port}{health}", timeout=10).status_code == 200


def test_the_caps_come_from_the_budget_and_the_side_channel_keeps_16_kib():
    env = {"KVBRIDGE_MAX_HEAD_BYTES": "65536", "KVBRIDGE_MAX_HEADERS": "40"}
    budget = ConnectionBudget.load(None, env)
    assert (budget.max_head_bytes, budget.max_headers) == (65536, 40)
    api = guarded_protocol(BoundedHttpTools, budget, "engine API")
    side = guarded_protocol(HeadLimitedHttpTools, ConnectionBudget.load(
        None, env, side_channel=True), "side channel")
    assert (api.head_limit, api.header_limit) == (65536, 40)
    assert (side.head_limit, side.header_limit) == (MAX_REQUEST_BYTES, 40)
    with pytest.raises(ConfigError, match="KVBRIDGE_MAX_HEAD_BYTES"):
        ConnectionBudget.load(None, {"KVBRIDGE_MAX_HEAD_BYTES": "100"})


# -- the cap's arithmetic, on an in-process server -------------------------------------------

LIMIT, LINES = 2048, 20
_names = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(str.encode)
_sizes = st.one_of(st.integers(0, 8), st.integers(100, 400))  # short lines, and long ones
_headers = st.integers(0, LINES + 6).flatmap(
    lambda n: st.lists(st.tuples(_names, _sizes), min_size=n, max_size=n))


async def _read_body(request: Request) -> Response:
    try:
        return PlainTextResponse(f"{len(await request.body())} bytes")
    except ClientDisconnect:  # refused while the body streamed
        return Response(status_code=499)


@pytest.fixture(scope="module")
def small_cap() -> Iterator[BackgroundServer]:
    app = Starlette(routes=[Route("/p", lambda r: PlainTextResponse("ok")),
                            Route("/body", _read_body, methods=["POST"])])
    budget = ConnectionBudget(max_head_bytes=LIMIT, max_headers=LINES)
    with BackgroundServer(app, **guarded_config("engine API", budget)) as server:
        yield server


def _exchange(port: int, head: bytes, pieces: list[int]) -> bytes:
    """``head`` sent cut at ``pieces`` (offsets), then everything the server answers."""
    with socket.create_connection((HOST, port), timeout=HEAD_TIMEOUT) as sock:
        cuts = [0, *sorted(p for p in pieces if 0 < p < len(head)), len(head)]
        try:
            for a, b in zip(cuts, cuts[1:], strict=False):
                sock.sendall(head[a:b])
        except ConnectionError:
            pass  # refused while sending: the answer is in the socket
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionError:
            pass
        return reply


@settings(max_examples=60, deadline=timedelta(seconds=HEAD_TIMEOUT), derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(headers=_headers, pieces=st.lists(st.integers(0, 10_000), max_size=6))
def test_a_head_is_refused_exactly_past_its_caps(small_cap, headers, pieces):
    """Within both caps: answered. Past the header-line cap, or past the byte cap as parsed
    (request target and header lines): 431 and closed, however the head is cut. Between
    (more bytes in all than the cap, fewer parsed): either, as the pieces fall."""
    lines = [name + b": " + b"v" * size + b"\r\n" for name, size in headers]
    head = (b"GET /p HTTP/1.1\r\n" + b"".join(lines) + b"connection: close\r\n\r\n")
    parsed = len(b"/p") + sum(len(line) for line in lines) + len(b"connection: close\r\n")
    count = len(lines) + 1
    reply = _exchange(small_cap.port, head, pieces)
    status = reply[9:12]
    event("over the line cap" if count > LINES else "over the byte cap" if parsed > LIMIT
          else "within" if len(head) <= LIMIT else "between")
    if count > LINES or parsed > LIMIT:
        assert status == b"431", (count, parsed, reply[:80])
        assert reply.count(b"HTTP/1.1") == 1  # one answer, then closed
    elif len(head) <= LIMIT:
        assert status == b"200", (count, len(head), reply[:80])
    else:
        assert status in (b"200", b"431"), reply[:80]


_CHUNKED = (b"POST /body HTTP/1.1\r\nhost: heads\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n5\r\nhello\r\n0\r\n")


@pytest.mark.parametrize(("trailers", "more"), [
    (b"".join(b"t%d: v\r\n" % i for i in range(LINES + 1)) + b"\r\n", b""),  # many
    (b"t: ", b"a" * 65536),  # one endless
    (b"5;x=", b"a" * 65536),  # an endless chunk extension: no body data, no end
], ids=["many trailers", "one endless trailer", "endless chunk extension"])
def test_a_chunked_bodys_trailers_count_as_its_head(small_cap, trailers, more):
    """Trailers go into the request's headers (uvicorn), and the parser buffers a trailer
    line until it ends: they count as head lines, and bytes received during a body with no
    body data among them (a trailer line, a chunk extension) as head bytes."""
    head = _CHUNKED[:-len(b"5\r\nhello\r\n0\r\n")] if trailers.startswith(b"5;") else _CHUNKED
    sock = socket.create_connection((HOST, small_cap.port))
    try:
        sock.sendall(head + trailers)
        sock.setblocking(False)
        sent, reply = 0, b""
        while True:
            wanted = [sock] if more and sent < CAP else []
            readable, writable, _ = select.select([sock], wanted, [], HEAD_TIMEOUT * 2)
            if readable:
                try:
                    chunk = sock.recv(65536)
                except ConnectionError:
                    chunk = b""
                if not chunk:
                    break
                reply += chunk
            elif writable:
                try:
                    sent += sock.send(more)
                except BlockingIOError:
                    pass
                except ConnectionError:
                    break
            else:
                break
    finally:
        sock.close()
    assert reply.startswith(b"HTTP/1.1 431 "), (reply[:100], sent)
    assert sent < TAKEN
