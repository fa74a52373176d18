"""Fuzz both side channels over their real sockets: thousands of generated requests,
no 5xx, no crash, and a good request still answered afterwards."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.config import TLSConfig
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.handshake.zmq.kvbridge_wire import ZmqHandshakeClient, ZmqHandshakeServer, ZmqReply
from tests.helpers import compat, full_store

TOKEN = "fuzz-token-1f"
FUZZ = settings(max_examples=1000, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
# Every status the http side channel documents; a 5xx other than 503 (not ready) is a bug.
DOCUMENTED = {200, 400, 401, 404, 405, 413, 422}

segments = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/?#%"),
                   max_size=12)
paths = st.one_of(
    st.builds(lambda s: "/v1/kv/handshake/" + s, segments),
    st.builds(lambda a, b: f"/{a}/{b}", segments, segments),
    st.sampled_from(["/v1/kv/handshake", "/healthz", "/readyz", "/", "/v1/kv/handshake/0",
                     "/v1/kv/handshake/-1", "/v1/kv/handshake/99999999999", "/docs"]))
printable = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=30)
auth = st.one_of(st.none(), st.just(f"Bearer {TOKEN}"), printable,
                 st.builds(lambda t: f"Bearer {t}", printable),
                 st.builds(lambda t: f"Basic {t}", printable))


@pytest.fixture(scope="module")
def http_server():
    server = HttpHandshakeServer(full_store(2), "127.0.0.1", 0, token=TOKEN, tls=TLSConfig())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http_client(http_server):
    with httpx.Client(base_url=f"http://127.0.0.1:{http_server.port}", timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def zmq_server():
    server = ZmqHandshakeServer(full_store(2), "127.0.0.1", 0, token=TOKEN)
    server.start()
    yield server
    server.stop()


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]),
       path=paths, authorization=auth,
       accept=st.sampled_from([None, "application/json", "application/vnd.msgpack", "*/*",
                               "text/html"]),
       body=st.one_of(st.none(), st.binary(max_size=256)),
       big_body=st.booleans())
def test_http_routes_never_fail_server_side(http_client, method, path, authorization, accept,
                                            body, big_body):
    headers = {k: v for k, v in (("authorization", authorization), ("accept", accept)) if v}
    if big_body:
        body = b"x" * (64 * 1024)
    r = http_client.request(method, path, headers=headers, content=body)
    assert r.status_code in DOCUMENTED, (method, path, r.status_code, r.text[:200])
    if r.status_code == 200 and path.startswith("/v1/kv/handshake"):
        assert authorization == f"Bearer {TOKEN}" and method in ("GET", "HEAD")
    if r.status_code == 401:
        assert b"agent" not in r.content and b"base_addrs" not in r.content


@FUZZ
@given(frames=st.lists(st.binary(max_size=300), min_size=1, max_size=4),
       structured=st.one_of(st.none(), st.fixed_dictionaries({
           "schema_version": st.one_of(st.integers(-3, 3), st.text(max_size=3)),
           "token": st.one_of(st.none(), st.just(TOKEN), st.text(max_size=10),
                              st.integers(-2**63, 2**63 - 1)),
           "tp_rank": st.one_of(st.none(), st.integers(-5, 5), st.floats(), st.text(max_size=3)),
       }, optional={"extra": st.integers(-2**63, 2**63 - 1)})))
def test_zmq_never_fails_server_side(zmq_server, frames, structured):
    if structured is not None:
        frames = [b"", msgspec.msgpack.encode(structured)]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{zmq_server.port}")
        sock.send_multipart(frames)
        assert sock.poll(10_000), "the side channel stopped answering"
        reply = msgspec.msgpack.decode(sock.recv_multipart()[-1], type=ZmqReply)
    finally:
        sock.close(linger=0)
    assert reply.status in (200, 400, 401, 404), reply
    if reply.status == 200:
        assert structured is not None and structured["token"] == TOKEN


def test_good_requests_still_answered_after_the_fuzzing(http_server, zmq_server):
    ranks = HttpHandshakeClient(5, compat(), TOKEN).fetch("127.0.0.1", http_server.port)
    assert [r.tp_rank for r in ranks] == [0, 1]
    ranks = ZmqHandshakeClient(5, compat(), TOKEN).fetch("127.0.0.1", zmq_server.port, 1)
    assert [r.tp_rank for r in ranks] == [1]
