"""The side channel end to end: real uvicorn / ZMQ servers on 127.0.0.1, real TLS, real clients.

The ranks carry synthetic agent metadata: no NIXL here.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import socket
import ssl
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvbridge.config import SideChannelConfig, TLSConfig
from kvbridge.errors import (
    AuthError,
    CompatibilityError,
    ConfigError,
    HandshakeError,
    HandshakeTimeout,
    WireFormatError,
)
from kvbridge.handshake import make_client, make_server
from kvbridge.handshake.base import MAX_REQUEST_BYTES, HandshakeClient, HandshakeServer
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.routes import MSGPACK, PATH
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.handshake.http.tls_sessions import cached_contexts, tls_sessions
from kvbridge.handshake.zmq.kvbridge_wire import (
    ZmqHandshakeClient,
    ZmqHandshakeServer,
    ZmqReply,
    ZmqRequest,
)
from kvbridge.metadata import SCHEMA_VERSION, encode_envelope
from kvbridge.tools.testing.certs import issue, new_ca
from tests.helpers import (
    CountingStore,
    RawServer,
    compat,
    full_store,
    rank_meta,
    read_request,
    refused_port,
)

TOKEN = "hs-token-5b2d0e"
HOST = "127.0.0.1"
METHODS = ["http", "zmq"]
TIMEOUT = 0.5  # for the tests that wait for a timeout
MARGIN = 3.0  # seconds: holds on a loaded 2-core machine
pack = msgspec.msgpack.encode


# --- servers and clients ----------------------------------------------------------------------

def server_tls(certs: Path, cert_reqs: int = ssl.CERT_NONE) -> TLSConfig:
    return TLSConfig(str(certs / "prefill.pem"), str(certs / "prefill.key"),
                     str(certs / "ca.pem"), cert_reqs)


def client_tls(certs: Path, ca: str = "ca.pem", cert: bool = False) -> TLSConfig:
    if cert:
        return TLSConfig(str(certs / "decode.pem"), str(certs / "decode.key"), str(certs / ca))
    return TLSConfig(ca_certs=str(certs / ca))


@contextlib.contextmanager
def serve(method: str, store, certs: Path | None = None, token: str | None = TOKEN,
          cert_reqs: int = ssl.CERT_NONE) -> Iterator[HandshakeServer]:
    if method == "http":
        tls = server_tls(certs, cert_reqs) if certs is not None else None
        server: HandshakeServer = HttpHandshakeServer(store, HOST, 0, token=token, tls=tls)
    else:
        server = ZmqHandshakeServer(store, HOST, 0, token=token)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def clients() -> Iterator:
    made: list[HandshakeClient] = []

    def make(method: str, certs: Path | None = None, *, token: str | None = TOKEN,
             timeout: float = 10.0, expected=None, max_message_bytes: int | None = None,
             tls: TLSConfig | None = None) -> HandshakeClient:
        expected = compat() if expected is None else expected
        kw = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        if method == "http":
            tls = tls or (client_tls(certs) if certs is not None else None)
            c: HandshakeClient = HttpHandshakeClient(timeout, expected, token, tls=tls, **kw)
        else:
            c = ZmqHandshakeClient(timeout, expected, token, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def store() -> CountingStore:
    return full_store(2)


@pytest.fixture(scope="module")
def servers(store, certs) -> Iterator[dict[str, HandshakeServer]]:
    """One http (TLS + token) and one zmq (token) server on the same full store."""
    with serve("http", store, certs) as http, serve("zmq", store) as zmq_server:
        yield {"http": http, "zmq": zmq_server}


def _client_certs(method: str, certs: Path) -> Path | None:
    return certs if method == "http" else None


def _elapsed(fn) -> tuple[BaseException, float]:
    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:
        fn()
    return ei.value, time.monotonic() - t0


# --- fetching ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_fetch_all_ranks(servers, store, clients, certs, method):
    client = clients(method, _client_certs(method, certs))
    ranks = client.fetch(HOST, servers[method].port)
    assert ranks == [rank_meta(0), rank_meta(1)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rank", [0, 1])
def test_fetch_one_rank(servers, store, clients, certs, method, rank):
    client = clients(method, _client_certs(method, certs))
    before = len(store.requests)
    assert client.fetch(HOST, servers[method].port, rank) == [rank_meta(rank)]
    assert store.requests[before:] == [rank]


@pytest.mark.parametrize("method", METHODS)
def test_store_not_complete(clients, certs, method):
    store = CountingStore(compat(), 2)
    store.set_rank(rank_meta(1))
    with serve(method, store, _client_certs(method, certs)) as server:
        client = clients(method, _client_certs(method, certs))
        with pytest.raises(HandshakeError, match=r"503.*1/2 ranks in; not ready") as ei:
            client.fetch(HOST, server.port, 1)
        assert not isinstance(ei.value, HandshakeTimeout)
        store.set_rank(rank_meta(0))
        assert client.fetch(HOST, server.port, 1) == [rank_meta(1)]
        client.close()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rank", [2, 7, 999999])
def test_rank_out_of_range(servers, clients, certs, method, rank):
    client = clients(method, _client_certs(method, certs))
    with pytest.raises(HandshakeError, match=f"404.*no tp_rank {rank}: tp_size is 2"):
        client.fetch(HOST, servers[method].port, rank)


@pytest.mark.parametrize("method", METHODS)
def test_make_server_and_client_from_settings(certs, clients, method):
    tls = {}
    if method == "http":
        tls = dict(ssl_certfile=str(certs / "prefill.pem"), ssl_keyfile=str(certs / "prefill.key"),
                   ssl_ca_certs=str(certs / "ca.pem"))
    config = SideChannelConfig.load({"handshake_method": method, "token": TOKEN,
                                     "trusted_side_channels": HOST,
                                     "side_channel_port": 0, **tls}, environ={})
    store = full_store(2)
    with make_server(config, store) as server:
        assert server.method == method and server.port != 0
        client = make_client(config, compat())
        try:
            assert client.method == method
            assert client.fetch(HOST, server.port) == [rank_meta(0), rank_meta(1)]
        finally:
            client.close()


@pytest.mark.parametrize("method", METHODS)
def test_make_server_on_a_port_in_use_is_a_config_error(method):
    """The bind itself (not only the CLI's early check) names the port and its setting."""
    with socket.socket() as busy:
        busy.bind((HOST, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        config = SideChannelConfig.load({"handshake_method": method, "side_channel_port": port},
                                        environ={})
        with pytest.raises(ConfigError, match=f"port {port} on {HOST} is already in use.*"
                           "--side-channel-port / KVBRIDGE_SIDE_CHANNEL_PORT"):
            make_server(config, full_store(1))


def test_http_server_stops_with_idle_tls_clients_connected(certs, clients):
    """A decode keeps its TLS connection pooled: stopping the prefill must not hang on it."""
    server = HttpHandshakeServer(full_store(2), HOST, 0, token=TOKEN, tls=server_tls(certs))
    server.start()
    client = clients("http", certs)
    port = server.port
    assert len(client.fetch(HOST, port)) == 2  # the connection stays in the pool
    server.stop()
    assert not server.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=5).close()


def test_http_server_sets_tcp_nodelay(servers, clients, certs):
    """Replies go out in two writes (head, body): with Nagle on, every keep-alive request
    would wait for the client's delayed ACK (~40 ms per handshake)."""
    client = clients("http", certs)
    client.fetch(HOST, servers["http"].port, 0)
    socks = servers["http"].open_sockets()
    assert socks
    for sock in socks:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


# --- http specifics ---------------------------------------------------------------------------

def _raw_client(certs: Path) -> httpx.Client:
    return httpx.Client(verify=client_tls(certs).client_context(), trust_env=False, timeout=10)


def _url(server: HandshakeServer, path: str) -> str:
    return f"https://{HOST}:{server.port}{path}"


SECRETS = ("agent-prefill-0", "prefill-0", "NIXLMD", "epoch-a")


def _assert_no_metadata(body: bytes) -> None:
    low = body.lower()
    for s in SECRETS:
        assert s.lower().encode() not in low, body
    base = rank_meta(0).kv.base_addrs[0]
    assert str(base).encode() not in body and hex(base).encode() not in low


def test_probes_without_token_reveal_nothing(certs):
    store = CountingStore(compat(), 2)
    store.set_rank(rank_meta(0))
    with serve("http", store, certs) as server, _raw_client(certs) as http:
        r = http.get(_url(server, "/healthz"))
        assert r.status_code == 200
        _assert_no_metadata(r.content)
        r = http.get(_url(server, "/readyz"))
        assert r.status_code == 503
        _assert_no_metadata(r.content)
        store.set_rank(rank_meta(1))
        r = http.get(_url(server, "/readyz"))
        assert r.status_code == 200
        _assert_no_metadata(r.content)
        assert r.text == "ready"
        assert store.requests == []  # probes never touch the metadata


def test_json_view(servers, certs):
    with _raw_client(certs) as http:
        headers = {"accept": "application/json", "authorization": f"Bearer {TOKEN}"}
        r = http.get(_url(servers["http"], PATH), headers=headers)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        view = r.json()
        assert view["schema_version"] == SCHEMA_VERSION
        assert view["compat"]["dtype"] == "float16"
        assert [x["tp_rank"] for x in view["ranks"]] == [0, 1]
        assert view["ranks"][1]["agent_name"] == rank_meta(1).agent_name
        assert base64.b64decode(view["ranks"][1]["agent_metadata"]) == rank_meta(1).agent_metadata
        assert view["ranks"][0]["kv"]["base_addrs"] == rank_meta(0).kv.base_addrs
        r = http.get(_url(servers["http"], PATH + "/1"), headers=headers)
        assert [x["tp_rank"] for x in r.json()["ranks"]] == [1]
        # without the JSON accept header: the msgpack envelope
        r = http.get(_url(servers["http"], PATH), headers={"authorization": f"Bearer {TOKEN}"})
        assert r.headers["content-type"] == MSGPACK
        assert r.content == encode_envelope(compat(), [rank_meta(0), rank_meta(1)])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1], ""])
def test_bad_token(servers, store, clients, certs, method, token):
    client = clients(method, _client_certs(method, certs), token=token)
    before = len(store.requests)
    with pytest.raises(AuthError, match="(?i)token"):
        client.fetch(HOST, servers[method].port)
    assert len(store.requests) == before  # refused before the store is asked


@pytest.mark.parametrize("auth", [None, "", "Bearer", "Bearer wrong", f"Basic {TOKEN}",
                                  f"Token {TOKEN}", f"Bearer  {TOKEN}"])
@pytest.mark.parametrize("path", [PATH, PATH + "/0", PATH + "/5"])
def test_401_reveals_no_metadata(servers, certs, auth, path):
    headers = {} if auth is None else {"authorization": auth}
    with _raw_client(certs) as http:
        for accept in (MSGPACK, "application/json"):
            r = http.get(_url(servers["http"], path), headers={**headers, "accept": accept})
            assert r.status_code == 401
            _assert_no_metadata(r.content)
            assert r.json()["error"]["message"] == "missing or invalid bearer token"
            assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_zmq_401_reveals_no_metadata(servers, token):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{HOST}:{servers['zmq'].port}")
        for rank in (None, 0, 5):
            sock.send_multipart([b"", pack(ZmqRequest(SCHEMA_VERSION, token, rank))])
            assert sock.poll(10_000)
            frames = sock.recv_multipart()
            reply = msgspec.msgpack.decode(frames[-1], type=ZmqReply)
            assert (reply.status, reply.envelope) == (401, b"")
            _assert_no_metadata(frames[-1])
    finally:
        sock.close(linger=0)


def test_bearer_scheme_is_case_insensitive(servers, certs):
    with _raw_client(certs) as http:
        r = http.get(_url(servers["http"], PATH), headers={"authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200


def test_plaintext_client_against_tls_server(servers, clients):
    client = clients("http", None)  # no CA: plain http
    assert client.scheme == "http"
    err, elapsed = _elapsed(lambda: client.fetch(HOST, servers["http"].port))
    assert isinstance(err, HandshakeError) and not isinstance(err, HandshakeTimeout), err
    assert "TLS" in str(err)
    assert elapsed < client.timeout


def _tls11_context(side: int, certs: Path) -> ssl.SSLContext:
    """A context that speaks at most TLS 1.1 (security level 0, or OpenSSL 3 would not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLSVersion.TLSv1_1 itself
        ctx = ssl.SSLContext(side)
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    if side == ssl.PROTOCOL_TLS_SERVER:
        ctx.load_cert_chain(str(certs / "prefill.pem"), str(certs / "prefill.key"))
    else:
        ctx.load_verify_locations(str(certs / "ca.pem"))
    return ctx


def test_side_channel_refuses_a_tls_1_1_client(servers, certs):
    """The TLS 1.2 floor (configuration.md, TLS): an older client gets no handshake.

    Python's own server default is TLS 1.2 as well, so this checks the behaviour; it
    would not notice the explicit floor alone being removed."""
    ctx = _tls11_context(ssl.PROTOCOL_TLS_CLIENT, certs)
    with socket.create_connection((HOST, servers["http"].port), timeout=10) as raw:
        # asyncio's server alerts or just closes the connection; either way no session
        with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION|UNSUPPORTED_PROTOCOL|EOF"):
            ctx.wrap_socket(raw, server_hostname=HOST)
    # while a TLS 1.2+ client of the same server is answered
    with _raw_client(certs) as http:
        r = http.get(_url(servers["http"], PATH), headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


def test_client_refuses_a_tls_1_1_server(clients, certs):
    ctx = _tls11_context(ssl.PROTOCOL_TLS_SERVER, certs)

    def tls11(conn: socket.socket) -> None:
        with contextlib.suppress(ssl.SSLError), ctx.wrap_socket(conn, server_side=True) as s:
            s.recv(1)  # never reached: the client refuses the protocol version

    with RawServer(tls11) as srv:
        client = clients("http", certs)
        err, elapsed = _elapsed(lambda: client.fetch(HOST, srv.port))
    assert isinstance(err, HandshakeError) and not isinstance(err, HandshakeTimeout), err
    assert "TLS" in str(err) and "version" in str(err).lower(), err
    assert elapsed < client.timeout


def test_server_certificate_from_untrusted_ca(servers, clients, certs):
    client = clients("http", tls=client_tls(certs, ca="other-ca.pem"))
    err, elapsed = _elapsed(lambda: client.fetch(HOST, servers["http"].port))
    assert isinstance(err, HandshakeError) and not isinstance(err, HandshakeTimeout), err
    assert "TLS" in str(err) and "certificate" in str(err).lower()
    assert elapsed < client.timeout


def test_server_certificate_for_another_host(servers, clients, tmp_path):
    issue(new_ca(tmp_path), tmp_path, "prefill", "prefill.example")
    with serve("http", full_store(2), tmp_path) as server:
        client = clients("http", tls=TLSConfig(ca_certs=str(tmp_path / "ca.pem")))
        with pytest.raises(HandshakeError, match="(?i)certificate"):
            client.fetch(HOST, server.port)


@pytest.fixture(scope="module")
def mtls_server(store, certs) -> Iterator[HandshakeServer]:
    with serve("http", store, certs, cert_reqs=ssl.CERT_REQUIRED) as server:
        yield server


def test_mtls_client_certificate_missing(mtls_server, clients, certs):
    client = clients("http", tls=client_tls(certs))
    err, elapsed = _elapsed(lambda: client.fetch(HOST, mtls_server.port))
    assert isinstance(err, HandshakeError) and not isinstance(err, HandshakeTimeout), err
    assert "certificate" in str(err).lower()
    assert elapsed < client.timeout


def test_mtls_client_certificate_from_another_ca(mtls_server, clients, certs, tmp_path):
    issue(new_ca(), tmp_path, "c", "decode")
    client = clients("http", tls=TLSConfig(str(tmp_path / "c.pem"), str(tmp_path / "c.key"),
                                           str(certs / "ca.pem")))
    err, _ = _elapsed(lambda: client.fetch(HOST, mtls_server.port))
    assert isinstance(err, HandshakeError) and not isinstance(err, HandshakeTimeout), err


def test_mtls_with_the_right_client_certificate(mtls_server, clients, certs):
    client = clients("http", tls=client_tls(certs, cert=True))
    assert client.fetch(HOST, mtls_server.port, 0) == [rank_meta(0)]
    # the token is still required on top of the certificate
    client = clients("http", tls=client_tls(certs, cert=True), token="nope")
    with pytest.raises(AuthError):
        client.fetch(HOST, mtls_server.port, 0)


def _resumed(client: HttpHandshakeClient, port: int) -> bool:
    """Whether the client's idle connection to the port resumed an earlier TLS session."""
    (sock,) = client.idle_sockets(HOST, port)
    return sock.session_reused


@pytest.mark.parametrize("cert", [False, True], ids=["tls", "mtls"])
def test_a_new_client_resumes_the_tls_session_of_an_earlier_one(servers, mtls_server, clients,
                                                                certs, cert):
    port = (mtls_server if cert else servers["http"]).port
    first = clients("http", tls=client_tls(certs, cert=cert))
    assert first.fetch(HOST, port, 0) == [rank_meta(0)]
    second = clients("http", tls=client_tls(certs, cert=cert))
    assert second.fetch(HOST, port, 1) == [rank_meta(1)]
    assert _resumed(second, port)
    # a client that trusts another CA shares nothing with them, and is refused
    with pytest.raises(HandshakeError, match="TLS"):
        clients("http", tls=client_tls(certs, ca="other-ca.pem")).fetch(HOST, port, 0)


def test_tls_context_is_replaced_not_added_when_its_files_rotate(servers, clients, certs,
                                                                 tmp_path):
    """A rotated CA file gets a new context (the old one and its sessions dropped): the
    cache holds one context per TLS setting however often its files change."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes((certs / "ca.pem").read_bytes())
    tls = TLSConfig(ca_certs=str(ca))
    port = servers["http"].port
    assert clients("http", tls=tls).fetch(HOST, port, 0) == [rank_meta(0)]
    first = tls_sessions(tls)
    count = cached_contexts()
    for i, name in enumerate(["other-ca.pem", "ca.pem"] * 3):
        ca.write_bytes((certs / name).read_bytes())
        os.utime(ca, ns=(time.time_ns(), time.time_ns() + (i + 1) * 10**9))  # a new version
        client = clients("http", tls=tls)
        if name == "ca.pem":
            assert client.fetch(HOST, port, 1) == [rank_meta(1)]
        else:  # the rotated file is the one used
            with pytest.raises(HandshakeError, match="TLS"):
                client.fetch(HOST, port, 1)
        assert cached_contexts() == count
    assert tls_sessions(tls) is not first


# --- keep-alive, redirects ---------------------------------------------------------------------

def _keepalive_replier(body: bytes, answers: int, accepted: list):
    """Answers ``answers`` requests per connection, then reads one more and closes without
    an answer (a keep-alive connection the server ends as the next request arrives)."""
    def handler(conn: socket.socket) -> None:
        accepted.append(conn)
        for _ in range(answers):
            read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
        read_request(conn)
        conn.close()
    return handler


def test_http_fetches_reuse_one_connection(clients):
    body = encode_envelope(compat(), [rank_meta(0)])
    accepted: list = []
    with RawServer(_keepalive_replier(body, 5, accepted)) as srv:
        client = clients("http")
        for _ in range(5):
            assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
    assert len(accepted) == 1


def test_keepalive_connection_closed_by_the_peer_is_replaced(clients):
    body = encode_envelope(compat(), [rank_meta(0)])
    accepted: list = []
    with RawServer(_keepalive_replier(body, 1, accepted)) as srv:
        client = clients("http")
        for _ in range(3):
            assert client.fetch(HOST, srv.port, 0) == [rank_meta(0)]
    assert len(accepted) == 3


def test_http_redirect_is_not_followed(clients):
    accepted: list = []
    with RawServer(lambda conn: (accepted.append(conn), _http_replier(
            b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://127.0.0.1:1/\r\n"
            b"content-length: 0\r\nconnection: close\r\n\r\n")(conn))) as srv:
        with pytest.raises(HandshakeError, match="answered 307"):
            clients("http").fetch(HOST, srv.port, 0)
    assert len(accepted) == 1


# --- timeouts ---------------------------------------------------------------------------------

def _assert_times_out(client: HandshakeClient, port: int, match: str = "") -> HandshakeTimeout:
    err, elapsed = _elapsed(lambda: client.fetch(HOST, port))
    assert isinstance(err, HandshakeTimeout), repr(err)
    assert elapsed < TIMEOUT + MARGIN, elapsed
    if match:
        assert match in str(err), err
    return err


@pytest.mark.parametrize("method,tls", [("http", False), ("http", True), ("zmq", False)])
def test_listening_but_never_accepting(clients, certs, method, tls):
    with RawServer(None) as silent:
        client = clients(method, certs if tls else None, timeout=TIMEOUT)
        _assert_times_out(client, silent.port)


@pytest.mark.parametrize("method", METHODS)
def test_accepting_but_never_answering(clients, certs, method):
    accepted = threading.Event()

    def hold(conn: socket.socket) -> None:
        accepted.set()
        srv.stopped.wait()

    with RawServer(hold) as srv:
        client = clients(method, _client_certs(method, certs), timeout=TIMEOUT)
        _assert_times_out(client, srv.port)
        assert accepted.wait(5)


@pytest.mark.parametrize("method", METHODS)
def test_refused_port_retries_until_the_deadline(clients, method):
    client = clients(method, timeout=TIMEOUT)
    # each refusal is seen and retried until the deadline ("gave up")
    _assert_times_out(client, refused_port(), "gave up after")


# --- malformed and oversized replies ----------------------------------------------------------

def _http_replier(response: bytes):
    def handler(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(response)
        conn.close()
    return handler


def _http_200(body: bytes, chunked: bool = False) -> bytes:
    if chunked:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                          for i in range(0, len(body), 1000))
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunks + b"0\r\n\r\n")
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body)) + body


@pytest.mark.parametrize("response", [
    b"\x00\x01\x02garbage\xff\xfe\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.6\r\nInvalid SSH identification string.\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort",
], ids=["binary", "ssh-banner", "truncated"])
def test_http_garbage_reply(clients, response):
    with RawServer(_http_replier(response)) as srv:
        client = clients("http")
        with pytest.raises(WireFormatError):
            client.fetch(HOST, srv.port)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("chunked", [False, True])
def test_http_200_with_random_body(clients, seed, chunked):
    body = random.Random(seed).randbytes(random.Random(seed).randrange(1, 5000))
    with RawServer(_http_replier(_http_200(body, chunked))) as srv:
        client = clients("http")
        with pytest.raises(WireFormatError, match=f"http://{HOST}:{srv.port}"):
            client.fetch(HOST, srv.port)


def test_http_reply_for_another_rank(clients):
    body = encode_envelope(compat(), [rank_meta(0)])
    with RawServer(_http_replier(_http_200(body))) as srv:
        client = clients("http")
        with pytest.raises(WireFormatError, match=r"answered ranks \[0\] when asked for rank 1"):
            client.fetch(HOST, srv.port, 1)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_http_raw_reply_over_the_limit(clients, chunked):
    body = encode_envelope(compat(), [rank_meta(0, 1, agent_metadata=b"m" * 50_000)])
    with RawServer(_http_replier(_http_200(body, chunked))) as srv:
        client = clients("http", max_message_bytes=10_000)
        with pytest.raises(WireFormatError, match="exceeds the limit of 10000"):
            client.fetch(HOST, srv.port)


@pytest.fixture(scope="module")
def big_servers(certs) -> Iterator[tuple[dict[str, HandshakeServer], int]]:
    store = full_store(1, agent_metadata=os.urandom(64 * 1024))
    size = len(store.reply(None).body)
    with serve("http", store, certs) as http, serve("zmq", store) as zmq_server:
        yield {"http": http, "zmq": zmq_server}, size


@pytest.mark.parametrize("method", METHODS)
def test_reply_just_over_the_limit(big_servers, clients, certs, method):
    servers, size = big_servers
    ok = clients(method, _client_certs(method, certs), max_message_bytes=size)
    assert len(ok.fetch(HOST, servers[method].port)) == 1
    client = clients(method, _client_certs(method, certs), max_message_bytes=size - 1)
    with pytest.raises(WireFormatError, match=f"{size - 1}"):
        client.fetch(HOST, servers[method].port)


def test_zmq_reply_far_over_the_limit(big_servers, clients):
    """Refused as its first frame's size is read, long before the deadline, naming the limit."""
    servers, size = big_servers
    client = clients("zmq", max_message_bytes=size // 4, timeout=30)
    err, elapsed = _elapsed(lambda: client.fetch(HOST, servers["zmq"].port))
    assert isinstance(err, WireFormatError), repr(err)
    assert f"max_message_bytes {size // 4}" in str(err), err
    assert elapsed < 30 / 2, elapsed


def test_http_reply_far_over_the_limit(big_servers, clients, certs):
    servers, size = big_servers
    client = clients("http", certs, max_message_bytes=size // 4)
    with pytest.raises(WireFormatError, match=f"{size} bytes exceeds the limit of {size // 4}"):
        client.fetch(HOST, servers["http"].port)


@contextlib.contextmanager
def zmq_replier(reply_frames) -> Iterator[int]:
    """A raw ROUTER answering every request with ``reply_frames``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port(f"tcp://{HOST}")
    stop = threading.Event()

    def run() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                ident, *_ = sock.recv_multipart()
                sock.send_multipart([ident, *reply_frames])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield port
    finally:
        stop.set()
        t.join(5)
        sock.close(linger=0)


@pytest.mark.parametrize("frames", [
    [b"", b"\xc1garbage"],
    [b"", b"random bytes that are not msgpack at all"],
    [b"", pack({"status": 200, "error": "", "envelope": b"", "extra": 1})],
    [b"", pack({"status": "200", "error": "", "envelope": b""})],
    [b"", pack(ZmqReply(200, "", b"\x93\x01\x02\x03"))],
    [b"", pack(ZmqReply(200, "", os.urandom(300)))],
], ids=["c1", "text", "extra-field", "wrong-type", "bad-envelope", "random-envelope"])
def test_zmq_garbage_reply(clients, frames):
    with zmq_replier(frames) as port:
        with pytest.raises(WireFormatError, match=f"zmq://{HOST}:{port}"):
            clients("zmq").fetch(HOST, port)


@pytest.mark.parametrize("method", METHODS)
def test_compat_mismatch(servers, clients, certs, method):
    client = clients(method, _client_certs(method, certs), expected=compat(dtype="bfloat16"))
    with pytest.raises(CompatibilityError) as ei:
        client.fetch(HOST, servers[method].port)
    assert set(ei.value.fields) == {"dtype"}
    assert "dtype: ours='bfloat16' theirs='float16'" in str(ei.value)


# --- robustness -------------------------------------------------------------------------------

def _raw_exchange(port: int, data: bytes, ctx: ssl.SSLContext | None = None) -> bytes:
    """Send ``data``, half-close, return whatever comes back until the server closes
    (over TLS, which cannot half-close: until the end of the response head)."""
    with socket.create_connection((HOST, port), timeout=10) as raw:
        sock = ctx.wrap_socket(raw, server_hostname=HOST) if ctx else raw
        out = b""
        try:
            sock.sendall(data)
            if ctx is None:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                out += chunk
                if ctx is not None and b"\r\n\r\n" in out:
                    break
        except (ConnectionError, ssl.SSLError):
            pass
        return out


def _status(response: bytes) -> int | None:
    if not response.startswith(b"HTTP/1.1 "):
        return None
    return int(response[9:12])


def test_http_body_over_the_limit_is_413(servers, certs):
    ctx = client_tls(certs).client_context()
    for path in (PATH, PATH + "/0", "/healthz"):
        request = (f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
                   f"content-length: {MAX_REQUEST_BYTES + 1}\r\n\r\n").encode()
        assert _status(_raw_exchange(servers["http"].port, request, ctx)) == 413
    with _raw_client(certs) as http:
        r = http.request("GET", _url(servers["http"], PATH), content=b"x" * (MAX_REQUEST_BYTES + 1),
                         headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 413
        assert b"prefill" not in r.content
        # at the limit the body is accepted (and ignored)
        r = http.request("GET", _url(servers["http"], PATH), content=b"x" * MAX_REQUEST_BYTES,
                         headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


def _chunked_head(path: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            "transfer-encoding: chunked\r\n\r\n").encode()


_CHUNK = b"%x\r\n%s\r\n" % (4096, b"x" * 4096)


def test_http_chunked_body_over_the_limit_is_413_and_closed(store):
    """A chunked body declares no length to refuse up front: it is counted as it streams,
    answered 413 once over the limit (unless already answered), and the connection closed,
    so a client cannot pour gigabytes into the side channel."""
    with serve("http", store, None) as server:
        # The head and more than the limit at once: refused before the app answers.
        over = _chunked_head(PATH + "/0") + _CHUNK * (MAX_REQUEST_BYTES // 4096 + 1)
        with socket.create_connection((HOST, server.port), timeout=10) as s:
            s.sendall(over)
            reply = b""
            with contextlib.suppress(ConnectionError, TimeoutError):
                while chunk := s.recv(65536):
                    reply += chunk
        assert _status(reply) == 413, reply[:100]
        assert b"prefill" not in reply

        # The head first, answered (200) while the body streams on: closed once over the limit.
        with socket.create_connection((HOST, server.port), timeout=10) as s:
            s.sendall(_chunked_head(PATH + "/0"))
            assert _status(s.recv(65536)) == 200
            sent = 0
            with contextlib.suppress(ConnectionError):
                while sent < 256 << 20:
                    s.sendall(_CHUNK * 16)
                    sent += len(_CHUNK) * 16
        # what the kernel's socket buffers took before the reset, not gigabytes
        assert sent < 16 << 20, f"{sent} bytes of body taken"

        # within the limit a chunked body is accepted (and ignored); the server goes on
        within = _chunked_head(PATH + "/0") + _CHUNK * 3 + b"0\r\n\r\n"
        assert _status(_raw_exchange(server.port, within)) == 200


@pytest.mark.parametrize("pieces", [1, 40], ids=["one-write", "trickled"])
def test_http_head_over_the_limit_is_431(servers, store, pieces):
    """A request head over the limit is refused whether it arrives at once or in pieces;
    the server goes on answering."""
    head = (f"GET {PATH} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
            "x-junk: ").encode() + b"a" * (MAX_REQUEST_BYTES + 1) + b"\r\n\r\n"
    with serve("http", store, None) as server:
        with socket.create_connection((HOST, server.port), timeout=10) as s:
            step = -(-len(head) // pieces)
            with contextlib.suppress(ConnectionError):
                for i in range(0, len(head), step):
                    s.sendall(head[i:i + step])
            reply = b""
            with contextlib.suppress(ConnectionError):
                while chunk := s.recv(65536):
                    reply += chunk
        assert _status(reply) == 431, reply[:100]
        ok = (f"GET {PATH}/0 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
              "connection: close\r\n\r\n").encode()
        assert _status(_raw_exchange(server.port, ok)) == 200


def _garbage_requests(rng: random.Random) -> list[bytes]:
    auth = f"authorization: Bearer {TOKEN}\r\n"
    out = []
    for _ in range(60):
        out.append(rng.randbytes(rng.randrange(1, 2000)))
    for _ in range(20):  # huge headers
        out.append(f"GET {PATH} HTTP/1.1\r\nhost: x\r\n{auth}x-junk: ".encode()
                   + b"a" * rng.randrange(MAX_REQUEST_BYTES, 4 * MAX_REQUEST_BYTES) + b"\r\n\r\n")
    for _ in range(20):  # many headers
        out.append(f"GET {PATH} HTTP/1.1\r\nhost: x\r\n{auth}".encode()
                   + b"".join(b"h%d: v\r\n" % i for i in range(rng.randrange(500, 3000)))
                   + b"\r\n")
    for _ in range(20):  # bodies over the limit, lying or bad content-lengths
        cl = rng.choice([str(MAX_REQUEST_BYTES + rng.randrange(1, 10**9)), "-1", "abc", "1e9",
                         "99999999999999999999999"])
        out.append(f"GET {PATH}/0 HTTP/1.1\r\nhost: x\r\n{auth}content-length: {cl}\r\n\r\n"
                   .encode() + rng.randbytes(100))
    for _ in range(20):  # broken request lines and versions
        out.append(rng.choice([b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\r\n\r\n\r\n",
                               b"GET /v1/kv/handshake HTTP/1.1\r\n\r\n",  # no host
                               b"GET /v1/kv/handshake HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",
                               b"BREW /v1/kv/handshake HTTP/1.1\r\nhost: x\r\n\r\n",
                               b"GET " + b"/a" * 20000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"]))
    return out


def _garbage_paths(rng: random.Random) -> list[str]:
    fixed = ["/", "/v1", "/v1/kv", PATH + "/", PATH + "/-1", PATH + "/abc", PATH + "/1.0",
             PATH + "/0x1", PATH + "/1e3", PATH + "/\u0663", PATH + "/%31", PATH + "/0/0",
             PATH + "/" + "9" * 40, PATH + "/%00", "/../../etc/passwd", "/healthz/x",
             PATH + "?tp_rank=0", "/" + "x" * 8000]
    alphabet = "abc019-._~%/:@!$&'()*+,;=\u00e9\u4e2d"
    rand = ["/" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
            for _ in range(80)]
    return fixed + rand


def test_http_survives_malformed_requests(certs, store):
    rng = random.Random(1234)
    # plaintext so the garbage reaches the HTTP parser and the app, with the token so that
    # requests pass authentication and reach the rank parsing
    with serve("http", store, None) as server, serve("http", store, certs) as tls_server:
        statuses = Counter(_status(_raw_exchange(server.port, data))
                           for data in _garbage_requests(rng))
        # refused (4xx or closed), or answered when the request was well-formed after all;
        # never a 5xx
        # (401: a head without a host header reaches the token check: httptools, unlike h11,
        # does not require one)
        assert set(statuses) <= {None, 200, 400, 401, 404, 405, 413, 414, 431}, statuses
        assert statuses[413] and statuses[400], statuses

        with httpx.Client(trust_env=False, timeout=10) as http:
            headers = {"authorization": f"Bearer {TOKEN}"}
            paths = Counter()
            for path in _garbage_paths(rng):
                r = http.get(f"http://{HOST}:{server.port}{path}", headers=headers)
                paths[r.status_code] += 1
                assert r.status_code < 500, (path, r)
                if r.status_code == 200:  # e.g. /v1/kv/handshake?x or .../%31 (= /1)
                    assert r.content.startswith(b"\x84\xaeschema_version"), path
            assert paths[404] > 80, paths
            for m in ("POST", "PUT", "DELETE", "PATCH"):
                r = http.request(m, f"http://{HOST}:{server.port}{PATH}", headers=headers)
                assert r.status_code == 405

        for _ in range(40):  # plaintext and junk on the TLS port
            _raw_exchange(tls_server.port, rng.randbytes(rng.randrange(1, 3000)))

        for port, c in ((server.port, None), (tls_server.port, certs)):
            client = HttpHandshakeClient(5, compat(), TOKEN,
                                         tls=client_tls(c) if c else None)
            try:
                assert client.fetch(HOST, port, 1) == [rank_meta(1)]
            finally:
                client.close()


def test_zmq_survives_malformed_requests(store, clients):
    rng = random.Random(99)
    with serve("zmq", store) as server:
        ctx = zmq.Context.instance()
        endpoint = f"tcp://{HOST}:{server.port}"

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        answered: list[list[bytes]] = []
        expect = []
        payloads = [rng.randbytes(rng.randrange(0, 500)) for _ in range(100)]
        payloads += [
            pack({"schema_version": SCHEMA_VERSION, "token": TOKEN, "tp_rank": "0"}),
            pack({"schema_version": SCHEMA_VERSION, "token": TOKEN, "tp_rank": 0, "x": 1}),
            pack({"schema_version": SCHEMA_VERSION, "token": TOKEN}),
            pack({"schema_version": SCHEMA_VERSION + 1, "token": TOKEN, "tp_rank": 0}),
            pack({"schema_version": SCHEMA_VERSION, "token": 5, "tp_rank": 0}),
            pack([SCHEMA_VERSION, TOKEN, 0]),
            pack(None), b"", b"\xc1",
        ]
        for p in payloads:
            dealer.send_multipart([b"", p])
            expect.append(400)
        for rank in (-1, 2, 2**40, 2**64 - 1):
            dealer.send_multipart([b"", pack(ZmqRequest(SCHEMA_VERSION, TOKEN, rank))])
            expect.append(404)
        for frames in ([b"no-delimiter"], [b"", b"a", b"b"], [b"x", b"y", b"z", b"w"],
                       [b"", b""]):
            dealer.send_multipart(frames)
            expect.append(400)
        for _ in range(len(expect)):
            assert dealer.poll(10_000), "the server stopped answering"
            answered.append(dealer.recv_multipart())
        statuses = [msgspec.msgpack.decode(f[-1], type=ZmqReply).status for f in answered]
        assert statuses == expect
        dealer.close(linger=0)

        # messages over the request limit: libzmq drops the connection, no reply
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(endpoint)
        for _ in range(5):
            big.send_multipart([b"", b"\x00" * (MAX_REQUEST_BYTES + 1)])
        big.close(linger=0)

        # raw TCP garbage and a truncated ZMTP greeting on the zmq port
        for _ in range(40):
            _raw_exchange(server.port, rng.randbytes(rng.randrange(1, 2000)))
        _raw_exchange(server.port, b"\xff" + b"\x00" * 8 + b"\x7f\x03")

        # a REQ client (adds its own delimiter) and the real client still work
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(endpoint)
        req.send(pack(ZmqRequest(SCHEMA_VERSION, TOKEN, 0)))
        assert req.poll(10_000)
        assert msgspec.msgpack.decode(req.recv(), type=ZmqReply).status == 200
        req.close(linger=0)
        assert clients("zmq").fetch(HOST, server.port) == [rank_meta(0), rank_meta(1)]


def _trickle_body(conn: socket.socket, release: threading.Event) -> None:
    read_request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n"
                 b"content-length: 1000\r\n\r\n")
    while not release.wait(0.9):  # a byte every 0.9 s: each gap fits in the timeout
        conn.sendall(b"x")


def _trickle_head(conn: socket.socket, release: threading.Event) -> None:
    read_request(conn)
    for b in b"HTTP/1.1 200 OK\r\ncontent-type: application/vnd.msgpack\r\n" * 20:
        if release.wait(0.3):
            return
        conn.sendall(bytes([b]))


@pytest.mark.parametrize("trickle", [_trickle_body, _trickle_head], ids=["body", "head"])
def test_http_reply_trickled_byte_by_byte_is_cut_at_the_deadline(trickle):
    """A peer that sends its reply (head or body) a byte at a time must not stretch the
    handshake past its timeout (each read getting the full remaining time would)."""
    release = threading.Event()
    with RawServer(lambda conn: trickle(conn, release)) as srv:
        client = HttpHandshakeClient(1.0, compat(), None)
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            client.fetch("127.0.0.1", srv.port, 0)
        elapsed = time.monotonic() - t0
        release.set()
        client.close()
    # unbounded, the reply would take minutes (1000 bytes at 0.9 s, or 0.3 s, each)
    assert elapsed < 1.0 + MARGIN


@pytest.mark.parametrize("method", ["http", "zmq"])
def test_observer_sees_every_answered_request(method):
    """What the side channel reports to metrics: route, status, bytes of each answer."""
    seen: list[tuple[str, int, int]] = []
    store = full_store(2)
    cls = HttpHandshakeServer if method == "http" else ZmqHandshakeServer
    server = cls(store, HOST, 0, token=TOKEN, observer=lambda *a: seen.append(a))
    server.start()
    try:
        good = make_client(SideChannelConfig(handshake_method=method, token=TOKEN,
                                             trusted_side_channels=HOST), compat())
        bad = make_client(SideChannelConfig(handshake_method=method, token="nope",
                                            trusted_side_channels=HOST), compat())
        good.fetch(HOST, server.port, 1)
        with pytest.raises(AuthError):
            bad.fetch(HOST, server.port, 1)
        good.close()
        bad.close()
    finally:
        server.stop()
    route = "handshake_rank" if method == "http" else "handshake"
    assert [(r, s) for r, s, _ in seen] == [(route, 200), (route, 401)]
    assert seen[0][2] == len(store.reply(1).body)
