"""Connection budgets (kvbridge.guard) on a real side-channel server and a real uvicorn
engine-API server: idle floods, slowloris heads, the cap and its eviction order."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvbridge.config import TLSConfig
from kvbridge.errors import ConfigError
from kvbridge.guard import ConnectionBudget, guarded_config
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.tools.testing.api_server import BackgroundServer
from tests.conftest import ROOT
from tests.helpers import compat, full_store, wait_until

HOST = "127.0.0.1"
TOKEN = "guard-token"
HANDSHAKE_TIMEOUT = 10.0  # the handshake clients' own deadline
FLOOD_DEADLINE = 60.0  # first-byte and head timeouts of the flooded servers: held that long


def _flood_bound(budget: ConnectionBudget) -> float:
    """How long a handshake may take while a flood is held: less than the earlier of the
    flood's own deadline (an answer after it could be one that waited for the flood to be
    shed) and the client's; seconds, where an idle machine takes milliseconds."""
    return min(HANDSHAKE_TIMEOUT, budget.first_byte_timeout, budget.head_timeout)


def _server(budget: ConnectionBudget, tls: TLSConfig | None = None) -> HttpHandshakeServer:
    server = HttpHandshakeServer(full_store(1), HOST, 0, token=TOKEN, tls=tls, budget=budget)
    server.start()
    return server


@contextlib.contextmanager
def _open(port: int, n: int) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection((HOST, port)))
        yield socks
    finally:
        for s in socks:
            s.close()


def _closed_by_peer(s: socket.socket, within: float = 30.0) -> bool:
    """True once the server closed ``s`` (EOF or reset), False if it still holds it."""
    s.settimeout(within)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_idle_flood_does_not_deny_a_handshake(certs):
    budget = ConnectionBudget(max_connections=64, first_byte_timeout=FLOOD_DEADLINE,
                              head_timeout=FLOOD_DEADLINE)
    server = _server(budget)
    client = HttpHandshakeClient(HANDSHAKE_TIMEOUT, compat(), TOKEN)
    try:
        with _open(server.port, 300) as flood:
            start = time.monotonic()
            metas = client.fetch(HOST, server.port)
            took = time.monotonic() - start
            assert len(metas) == 1 and took < _flood_bound(budget), took
            # the oldest idle connections were the ones closed to make room
            assert _closed_by_peer(flood[0])
            assert not _closed_by_peer(flood[-1], within=0.2)
    finally:
        client.close()
        server.stop()


def test_silent_and_slowloris_connections_are_closed():
    budget = ConnectionBudget(first_byte_timeout=0.5, head_timeout=0.5)
    server = _server(budget)
    try:
        with _open(server.port, 2) as (silent, slow):
            slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never ends the head
            assert _closed_by_peer(silent)
            assert _closed_by_peer(slow)
    finally:
        server.stop()


def test_idle_flood_over_mutual_tls(certs):
    tls = TLSConfig(
        str(certs / "prefill.pem"),
        str(certs / "prefill.key"),
        str(certs / "ca.pem"),
        ssl.CERT_REQUIRED,
    )
    budget = ConnectionBudget(max_connections=32, first_byte_timeout=FLOOD_DEADLINE,
                              head_timeout=FLOOD_DEADLINE)
    server = _server(budget, tls)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(str(certs / "decode.pem"), str(certs / "decode.key"))
    client = HttpHandshakeClient(
        HANDSHAKE_TIMEOUT,
        compat(),
        TOKEN,
        tls=TLSConfig(str(certs / "decode.pem"), str(certs / "decode.key"), str(certs / "ca.pem")),
    )
    flood: list[ssl.SSLSocket] = []
    try:
        for _ in range(100):
            flood.append(
                ctx.wrap_socket(socket.create_connection((HOST, server.port)), server_hostname=HOST)
            )
        start = time.monotonic()
        assert len(client.fetch(HOST, server.port)) == 1
        assert time.monotonic() - start < _flood_bound(budget)
        assert _closed_by_peer(flood[0])
    finally:
        for s in flood:
            s.close()
        client.close()
        server.stop()


def test_silent_client_of_a_tls_server_is_closed_at_the_first_byte_deadline(certs):
    """No ClientHello: the TLS handshake is bounded by the first-byte deadline, not by
    asyncio's 60 s."""
    tls = TLSConfig(
        str(certs / "prefill.pem"),
        str(certs / "prefill.key"),
        str(certs / "ca.pem"),
        ssl.CERT_REQUIRED,
    )
    server = _server(ConnectionBudget(first_byte_timeout=0.5), tls)
    try:
        with _open(server.port, 1) as (silent,):
            assert _closed_by_peer(silent)
    finally:
        server.stop()


def test_engine_api_server_is_guarded():
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/health", ok)])
    budget = ConnectionBudget(max_connections=16, first_byte_timeout=0.5, head_timeout=0.5)
    with BackgroundServer(app, **guarded_config("api", budget)) as srv:
        with _open(srv.port, 40) as flood:
            assert httpx.get(srv.url + "/health", timeout=10).text == "ok"
            assert _closed_by_peer(flood[-1])


def test_budget_from_the_settings_tree():
    env = {"KVBRIDGE_MAX_CONNECTIONS": "10", "KVBRIDGE_HEAD_TIMEOUT": "2.5",
           "KVBRIDGE_KEEP_ALIVE_TIMEOUT": "7"}
    b = ConnectionBudget.load(None, env)
    assert (b.max_connections, b.head_timeout, b.keep_alive_timeout) == (10, 2.5, 7.0)
    assert ConnectionBudget.load({"max_connections": 3}, env).max_connections == 3  # a flag wins
    # the side channel keeps its own keep-alive: KVBRIDGE_KEEP_ALIVE_TIMEOUT is not it
    side = ConnectionBudget.load(None, env, side_channel=True)
    assert (side.max_connections, side.keep_alive_timeout) == (10, 30.0)
    env["KVBRIDGE_SIDE_CHANNEL_KEEP_ALIVE_TIMEOUT"] = "12"
    assert ConnectionBudget.load(None, env, side_channel=True).keep_alive_timeout == 12.0
    with pytest.raises(ConfigError, match="KVBRIDGE_FIRST_BYTE_TIMEOUT='0'"):
        ConnectionBudget.load(None, {"KVBRIDGE_FIRST_BYTE_TIMEOUT": "0"})
    with pytest.raises(ConfigError, match="KVBRIDGE_MAX_CONNECTIONS='many': not an integer"):
        ConnectionBudget.load(None, {"KVBRIDGE_MAX_CONNECTIONS": "many"})
    with pytest.raises(ConfigError, match="max_connections=0"):
        ConnectionBudget(max_connections=0).validated()


_STOPPABLE_SERVER = """
import socket, sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from kvbridge.guard import ConnectionBudget, guarded_config

async def ok(request):
    return PlainTextResponse("ok")

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
print(sock.getsockname()[1], flush=True)
config = uvicorn.Config(Starlette(routes=[Route("/ok", ok)]), log_level="warning",
                        **guarded_config("api", ConnectionBudget(keep_alive_timeout=1.0)))
uvicorn.Server(config).run(sockets=[sock])
"""


def test_request_sent_to_a_stopped_server_is_answered_after_it_resumes():
    """The request reaches a keep-alive connection whose timer expires while the server
    process is stopped (SIGSTOP): on resume it is answered, not cut unread."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _STOPPABLE_SERVER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        url = f"http://{HOST}:{int(proc.stdout.readline())}"
        with httpx.Client(base_url=url, timeout=30) as client:
            # until uvicorn serves (the socket listens from the start)
            wait_until(lambda: client.get("/ok").text == "ok", 60, "uvicorn serving",
                       tolerate=(httpx.TransportError,), every=0.05)
            # the connection is idle now, with a keep-alive of 1 s
            proc.send_signal(signal.SIGSTOP)
            try:
                with cf.ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(client.get, "/ok")  # waits in the kernel's buffer
                    time.sleep(2)  # the stop itself, past the keep-alive timeout
                    proc.send_signal(signal.SIGCONT)
                    assert pending.result(timeout=30).text == "ok"
            finally:
                proc.send_signal(signal.SIGCONT)
    finally:
        proc.terminate()
        proc.wait(30)


def test_slow_request_body_is_cut_at_the_body_deadline():
    received = []

    async def upload(request):
        try:
            received.append(await request.body())
        except Exception as e:  # the disconnect the app sees
            received.append(type(e).__name__)
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/upload", upload, methods=["POST"])])
    budget = ConnectionBudget(body_timeout=0.5)
    with BackgroundServer(app, **guarded_config("api", budget)) as srv:
        with _open(srv.port, 1) as (slow,):
            slow.sendall(
                b"POST /upload HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\nonly ten.."
            )
            assert _closed_by_peer(slow)
        # a whole body in time is still read
        assert httpx.post(srv.url + "/upload", content=b"x" * 100, timeout=10).text == "ok"
    assert received[-1] == b"x" * 100
