"""Fuzz what faces the network on the zmq wires and in etcd: ZMTP frames to and from both
listeners and both clients (kvbridge's own side channel, vLLM's handshake), over real
loopback sockets, and the registry's reading of etcd (records, range replies, the watch
stream) as pure functions or from a fake etcd gateway on loopback.

Each asserts a valid result or a clean refusal (the project's exception, a dropped
connection), never another exception, never a hang past the deadline. The budget is small
by default (``KVBRIDGE_FUZZ_EXAMPLES`` examples per test, 50) to fit the fast loop: set it
higher to fuzz longer.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    KVBridgeError,
    RegistryError,
    RetryableHandshakeError,
    WireFormatError,
)
from kvbridge.handshake.zmq.dealer import zmtp_request
from kvbridge.handshake.zmq.kvbridge_wire import ZmqHandshakeClient, ZmqHandshakeServer, ZmqReply
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient, VllmZmqServer
from kvbridge.metadata import (
    PAYLOAD_SCHEMA_VERSION,
    SCHEMA_VERSION,
    PayloadEnvelope,
    RankMetadata,
    decode_payload_envelope,
    encode_payload_envelope,
)
from kvbridge.registry import (
    INSTANCES_PREFIX,
    EtcdEndpoint,
    EtcdRegistry,
    InstanceRecord,
    instance_key,
)
from tests import zmtp_raw
from tests.helpers import RawServer, compat, full_store

HOST = "127.0.0.1"
TOKEN = "fuzz-wire-token"
EXAMPLES = int(os.environ.get("KVBRIDGE_FUZZ_EXAMPLES", "50"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
DEADLINE = 5.0  # an answer or a closed connection by then, else the peer hung
TIMEOUT = 2.0  # the clients' handshake timeout, the registry's call timeout
SLACK = 3.0  # past the deadline, on two loaded cores: beyond it, the call hung
PAYLOADS = {(0, 0): b"rank-0", (0, 1): b"rank-1"}


class _Errors(logging.Handler):
    """ERROR records of the listeners' threads (an exception no handler caught)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def errors() -> Iterator[_Errors]:
    handler = _Errors()
    loggers = [logging.getLogger(n) for n in ("asyncio", "kvbridge")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.fixture(scope="module")
def kvbridge_server() -> Iterator[ZmqHandshakeServer]:
    server = ZmqHandshakeServer(full_store(2), HOST, 0, token=TOKEN)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[VllmZmqServer]:
    server = VllmZmqServer(PAYLOADS, HOST, 0)
    server.start()
    yield server
    server.stop()


# --- ZMTP bytes --------------------------------------------------------------------------

def _frames(bodies: list[bytes]) -> bytes:
    return b"".join(zmtp_raw.frame(b, more=i < len(bodies) - 1) for i, b in enumerate(bodies))


def _long_head(flags: int, size: int) -> bytes:
    return bytes([flags]) + struct.pack(">Q", size)


# A greeting: mostly right, else with one byte changed, else anything.
greetings = st.one_of(
    st.just(zmtp_raw.GREETING), st.just(zmtp_raw.GREETING), st.just(zmtp_raw.GREETING),
    st.builds(lambda i, b: zmtp_raw.GREETING[:i] + bytes([b]) + zmtp_raw.GREETING[i + 1:],
              st.integers(0, 63), st.integers(0, 255)),
    st.binary(max_size=70))
socket_types = st.sampled_from([b"DEALER", b"REQ", b"ROUTER", b"REP", b"PUB", b"PUSH", b""])
readies = st.one_of(
    st.builds(zmtp_raw.ready, socket_types), st.builds(zmtp_raw.ready, socket_types),
    st.builds(lambda b: zmtp_raw.frame(b"\x05READY" + b, command=True), st.binary(max_size=40)),
    st.builds(lambda b: zmtp_raw.frame(b, command=True), st.binary(max_size=40)),
    st.builds(zmtp_raw.frame, st.binary(max_size=20)),  # a message where READY should be
    st.binary(max_size=12))
# Frames as a peer may send them: right or wrong flags, lengths that lie, too many.
raw_frames = st.one_of(
    st.builds(lambda bodies: _frames(bodies), st.lists(st.binary(max_size=300), min_size=1,
                                                       max_size=12)),
    st.builds(lambda b, more: zmtp_raw.frame(b, more=more, command=True),
              st.binary(max_size=40), st.booleans()),
    st.builds(_long_head, st.integers(0, 255), st.integers(0, 2**64 - 1)),
    st.builds(lambda f, n: bytes([f, n]), st.integers(0, 255), st.integers(0, 255)),
    st.binary(max_size=40))


def _read_until_closed(s: socket.socket) -> bytes:
    """What the peer sent until it closed; a peer still silent at ``DEADLINE`` hung."""
    out, end = b"", time.monotonic() + DEADLINE
    while True:
        left = end - time.monotonic()
        assert left > 0, "the listener neither answered nor closed the connection"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError("the listener neither answered nor closed the connection"
                                 ) from None
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _messages(data: bytes) -> list[list[bytes]]:
    """The complete messages a ZMTP peer sent after its greeting, parsed strictly (an
    unfinished last one, cut by the close, is left out)."""
    if not data:
        return []
    assert data[:1] == b"\xff" and data[9:10] == b"\x7f", data[:64]
    out: list[list[bytes]] = []
    current: list[bytes] = []
    i = 64
    while i < len(data):
        flags = data[i]
        assert flags & ~0x07 == 0, f"bad flags {flags:#x} from the listener"
        if flags & 0x02:
            if i + 9 > len(data):
                break
            (size,) = struct.unpack(">Q", data[i + 1:i + 9])
            i += 9
        else:
            if i + 2 > len(data):
                break
            size, i = data[i + 1], i + 2
        if i + size > len(data):
            break
        body, i = data[i:i + size], i + size
        if flags & 0x04:
            continue  # READY
        current.append(body)
        if not flags & 0x01:
            out.append(current)
            current = []
    return out


def _exchange(port: int, data: bytes) -> list[list[bytes]]:
    """Send ``data`` on a new connection, half-close, read until the listener closes."""
    with socket.create_connection((HOST, port), timeout=DEADLINE) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # dropped while we sent: a refusal
            pass
        return _messages(_read_until_closed(s))


kvbridge_requests = st.one_of(
    st.builds(lambda d: [b"", msgspec.msgpack.encode(d)], st.fixed_dictionaries({
        "schema_version": st.one_of(st.just(SCHEMA_VERSION), st.integers(-3, 3),
                                    st.text(max_size=3)),
        "token": st.one_of(st.just(TOKEN), st.none(), st.text(max_size=10),
                               st.integers(-2**63, 2**64 - 1)),
        "tp_rank": st.one_of(st.none(), st.integers(-3, 3), st.floats(), st.text(max_size=2)),
    }, optional={"extra": st.integers(-2**63, 2**64 - 1)})),
    st.lists(st.binary(max_size=64), min_size=1, max_size=10))
vllm_requests = st.one_of(
    st.builds(lambda pp, tp: [b"", msgspec.msgpack.encode((b"get_meta_msg", pp, tp))],
              st.integers(-1, 1), st.integers(-1, 2)),
    st.builds(lambda m, pp, tp: [b"", msgspec.msgpack.encode((m, pp, tp))],
              st.sampled_from([b"get_meta_msg", b"other", "get_meta_msg"]),
              st.one_of(st.integers(-2, 2), st.integers(-2**63, 2**64 - 1), st.floats(), st.none()),
              st.one_of(st.integers(-2, 3), st.integers(-2**63, 2**64 - 1), st.text(max_size=2))),
    st.builds(lambda p: [msgspec.msgpack.encode(p)], st.lists(st.integers(0, 3), max_size=4)),
    st.lists(st.binary(max_size=64), min_size=1, max_size=10))


def _prefix(kinds: list[bytes]) -> st.SearchStrategy[bytes]:
    """A greeting and a READY: mostly right (of one of ``kinds``), so that what follows
    is read; else any of the wrong ones."""
    right = st.builds(lambda k: zmtp_raw.GREETING + zmtp_raw.ready(k), st.sampled_from(kinds))
    return st.one_of(right, right, right, st.builds(lambda g, r: g + r, greetings, readies))


def _client_bytes(requests: st.SearchStrategy[list[bytes]]) -> st.SearchStrategy[bytes]:
    """A whole client's bytes: greeting, READY, then requests and raw frames mixed."""
    body = st.lists(st.one_of(requests.map(_frames), requests.map(_frames), raw_frames),
                    min_size=1, max_size=4).map(b"".join)
    return st.builds(lambda p, b: p + b, _prefix([b"DEALER", b"REQ"]), body)


@FUZZ
@given(data=_client_bytes(kvbridge_requests))
def test_kvbridge_listener_answers_or_drops_never_hangs(kvbridge_server, errors, data):
    for reply in _exchange(kvbridge_server.port, data):
        assert len(reply) in (1, 2) and (len(reply) == 1 or reply[0] == b""), reply
        status = msgspec.msgpack.decode(reply[-1], type=ZmqReply).status
        assert status in (200, 400, 401, 404), status
    assert not errors.records, [r.getMessage() for r in errors.records]


@FUZZ
@given(data=_client_bytes(vllm_requests))
def test_vllm_listener_answers_or_drops_never_hangs(vllm_server, errors, data):
    for reply in _exchange(vllm_server.port, data):
        *delim, payload, clock = reply
        assert delim in ([], [b""]) and payload in (b"", *PAYLOADS.values()), reply
        assert math.isfinite(msgspec.msgpack.decode(clock, type=float))
    assert not errors.records, [r.getMessage() for r in errors.records]


# --- the clients against a fuzzed peer ---------------------------------------------------

class _Peer:
    """A raw ZMTP peer on loopback whose script (set per example) runs on each connection."""

    def __init__(self) -> None:
        self.script: Callable[[socket.socket], None] = lambda conn: None
        self.server = RawServer(self._run)
        self.port = self.server.port

    def _run(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(DEADLINE)
            try:
                self.script(conn)
                while conn.recv(65536):  # until the client lets go (no reset under it)
                    pass
            except OSError:
                pass


@pytest.fixture(scope="module")
def peer() -> Iterator[_Peer]:
    p = _Peer()
    yield p
    p.server.close()


def _sends(data: bytes) -> Callable[[socket.socket], None]:
    """Script: send ``data`` at once, then end our side."""
    def script(conn: socket.socket) -> None:
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
    return script


def _answers(reply: bytes) -> Callable[[socket.socket], None]:
    """Script: a ROUTER's greeting and READY, then ``reply`` to every request."""
    def script(conn: socket.socket) -> None:
        conn.sendall(zmtp_raw.GREETING + zmtp_raw.ready(b"ROUTER"))
        got = 0
        while got < 64:  # the client's greeting, then one request per read
            chunk = conn.recv(64 - got)
            if not chunk:
                return
            got += len(chunk)
        while conn.recv(65536):
            conn.sendall(reply)
    return script


def _timed(call: Callable[[], object]) -> object:
    t0 = time.monotonic()
    try:
        return call()
    finally:
        assert time.monotonic() - t0 < TIMEOUT + SLACK, "past the deadline"


@FUZZ
@given(prefix=_prefix([b"ROUTER", b"REP", b"DEALER"]), reply=st.lists(raw_frames, max_size=4))
def test_zmtp_client_bounds_any_reply(peer, prefix, reply):
    """One request by ``zmtp_request``: frames within the limits, or a clean refusal."""
    peer.script = _sends(prefix + b"".join(reply))
    try:
        frames = _timed(lambda: zmtp_request(HOST, peer.port, [b"", b"q"],
                                             deadline=time.monotonic() + TIMEOUT,
                                             max_bytes=1000, max_frames=4))
    except (WireFormatError, RetryableHandshakeError):
        return
    assert isinstance(frames, list) and 1 <= len(frames) <= 4
    assert sum(map(len, frames)) <= 1000


_envelope = full_store(2).reply(None).body
envelopes = st.one_of(
    st.just(_envelope),
    st.builds(lambda i, b: _envelope[:i] + bytes([b]) + _envelope[i + 1:],
              st.integers(0, len(_envelope) - 1), st.integers(0, 255)),
    st.builds(lambda n: _envelope[:n], st.integers(0, len(_envelope))),
    st.binary(max_size=100))
kvbridge_replies = st.one_of(
    st.builds(lambda s, e, env: [b"", msgspec.msgpack.encode(
        {"status": s, "error": e, "envelope": env})],
        st.sampled_from([200, 200, 400, 401, 404, 500, 503, -1, 2**40]),
        st.text(max_size=20), envelopes),
    st.builds(lambda d: [b"", msgspec.msgpack.encode(d)],
              st.dictionaries(st.text(max_size=8), st.integers(-2**63, 2**64 - 1), max_size=3)),
    st.lists(st.binary(max_size=200), min_size=1, max_size=9))


@FUZZ
@given(reply=kvbridge_replies)
def test_kvbridge_client_takes_or_refuses_any_reply(peer, reply):
    peer.script = _answers(_frames(reply))
    client = ZmqHandshakeClient(TIMEOUT, compat(), TOKEN)
    try:
        ranks = _timed(lambda: client.fetch(HOST, peer.port))
    except KVBridgeError:
        return
    assert [type(r) for r in ranks] == [RankMetadata, RankMetadata]


# A clock: any float (the specials as often as the rest), an int, or not msgpack at all.
clocks = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 12.5]), st.floats(),
    st.integers(-2**63, 2**64 - 1), st.binary(max_size=12)).map(
    lambda c: c if isinstance(c, bytes) else msgspec.msgpack.encode(c))
_vllm_reply = st.builds(lambda p, c: [b"", p, c], st.binary(min_size=1, max_size=64), clocks)
vllm_replies = st.one_of(
    _vllm_reply, _vllm_reply,
    st.builds(lambda p, c: [b"", p, c], st.binary(max_size=2000), clocks),
    st.lists(st.binary(max_size=64), min_size=1, max_size=5))


@FUZZ
@given(reply=vllm_replies)
def test_vllm_client_takes_or_refuses_any_reply(peer, reply):
    peer.script = _answers(_frames(reply))
    try:
        got = _timed(lambda: VllmZmqClient(TIMEOUT, 1024).fetch_ranks(HOST, peer.port,
                                                                [(0, 0), (0, 1)]))
    except KVBridgeError:
        return
    assert set(got.payloads) == {(0, 0), (0, 1)}
    assert all(0 < len(p) <= 1024 for p in got.payloads.values())
    assert math.isfinite(got.clock_offset), got.clock_offset


def test_both_listeners_still_answer_after_the_fuzzing(kvbridge_server, vllm_server, errors):
    ranks = ZmqHandshakeClient(5, compat(), TOKEN).fetch(HOST, kvbridge_server.port)
    assert [r.tp_rank for r in ranks] == [0, 1]
    got = VllmZmqClient(5, 1 << 20).fetch_ranks(HOST, vllm_server.port, [(0, 1), (0, 0)])
    assert got.payloads == {(0, 1): b"rank-1", (0, 0): b"rank-0"}
    assert not errors.records


# --- etcd: records and the gateway's JSON ------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
_record = {"engine_id": "decode-0", "epoch": "e1", "role": "decode",
           "api_url": "http://10.0.0.2:8000", "tp_size": 1, "compat_hash": "abc"}
urls = st.one_of(
    st.just("http://10.0.0.2:8000"), st.just("https://[::1]:8443/"),
    st.builds(lambda s, h, p: f"{s}://{h}{p}", st.sampled_from(["http", "https", "ftp", ""]),
              st.text(max_size=12), st.one_of(st.just(""), st.text(max_size=8).map(
                  lambda t: ":" + t), st.integers(-1, 10**6).map(lambda n: f":{n}"))),
    st.text(max_size=20))
records = st.one_of(
    st.fixed_dictionaries({k: st.one_of(st.just(v), json_values) for k, v in _record.items()},
                          optional={"side_channel_port": st.one_of(st.integers(-1, 70_000),
                                                                   json_values),
                                    "load": st.one_of(st.integers(-5, 5), json_values),
                                    "model": json_values, "extra": json_values})
    .map(lambda d: json.dumps(d).encode()),
    st.builds(lambda u, t: json.dumps({**_record, "api_url": u, "tp_size": t}).encode(),
              urls, st.integers(-2, 3)),
    st.binary(max_size=80))


@FUZZ
@given(data=records)
def test_an_etcd_record_is_usable_or_refused(data):
    """What the proxy's membership decodes from etcd: a record it can route to (an http(s)
    URL httpx takes, ports and sizes in range), or a msgspec error it ignores and counts."""
    try:
        record = InstanceRecord.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return
    url = httpx.URL(record.api_url)
    assert url.scheme in ("http", "https") and url.host and url.port in (None, *range(1, 65536))
    assert record.tp_size >= 1 and record.load >= 0
    assert record.side_channel_port is None or 1 <= record.side_channel_port <= 65535
    assert instance_key(record).startswith(INSTANCES_PREFIX)


class _Gateway:
    """A fake etcd gRPC gateway on loopback: every POST answered with ``body`` (set per
    example), then the connection closed (once ``hold`` is set, when there is one)."""

    def __init__(self) -> None:
        self.body = b"{}"
        self.hold: threading.Event | None = None
        gateway = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("connection", "close")
                self.end_headers()
                self.wfile.write(gateway.body)
                if gateway.hold is not None:  # a watch stream that stays open
                    gateway.hold.wait(30)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.registry = EtcdRegistry(EtcdEndpoint(HOST, self.server.server_address[1]),
                                     timeout=TIMEOUT)

    def close(self) -> None:
        self.registry.close()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[_Gateway]:
    g = _Gateway()
    yield g
    g.close()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


kvs = st.one_of(
    st.fixed_dictionaries({"key": st.one_of(st.binary(max_size=12).map(_b64), json_values)},
                          optional={"value": st.one_of(st.binary(max_size=40).map(_b64),
                                                       json_values),
                                    "mod_revision": st.one_of(st.integers(0, 99).map(str),
                                                              json_values),
                                    "create_revision": st.one_of(
                                        st.integers(0, 99).map(str), json_values)}),
    json_values)
revisions = st.one_of(st.integers(0, 10**6).map(str), st.integers(0, 10**6), json_values)
range_replies = st.one_of(
    st.fixed_dictionaries({"header": st.one_of(
        st.fixed_dictionaries({"revision": revisions}), json_values)},
        optional={"kvs": st.one_of(st.lists(kvs, max_size=4), json_values)}),
    json_values)


@FUZZ
@given(reply=range_replies)
def test_an_etcd_range_reply_is_read_or_refused(gateway, reply):
    gateway.body = json.dumps(reply).encode()
    try:
        got, revision = _timed(lambda: gateway.registry.get_prefix("/kvbridge/", 1000))
    except RegistryError:
        return
    assert isinstance(revision, int)
    assert all(isinstance(k, str) and isinstance(v, bytes) and len(v) <= 1000
               for k, v in got.items())
    entries, _ = gateway.registry.entries("/kvbridge/", 1000)
    assert all(isinstance(e.revision, int) and isinstance(e.created, int)
               for e in entries.values())


events = st.fixed_dictionaries({}, optional={
    "type": st.one_of(st.sampled_from(["PUT", "DELETE"]), json_values),
    "kv": kvs})
watch_messages = st.one_of(
    st.fixed_dictionaries({"result": st.one_of(st.fixed_dictionaries({}, optional={
        "events": st.one_of(st.lists(events, max_size=3), json_values),
        "compact_revision": st.one_of(st.just("0"), revisions),
        "canceled": json_values, "cancel_reason": json_values}), json_values)},
        optional={"error": json_values}),
    json_values)


lines = st.text(max_size=20).map(lambda t: t.replace("\n", " "))  # not always JSON


@FUZZ
@given(messages=st.lists(st.one_of(watch_messages.map(json.dumps), lines), max_size=4),
       cut=st.integers(0, 8))
def test_an_etcd_watch_stream_is_read_or_refused(gateway, messages, cut):
    """Events (str keys, bytes values, int revisions) until the stream ends: always a
    ``RegistryError`` then (``WatchCompacted`` included), never another exception."""
    stream = b"".join(m.encode() + b"\n" for m in messages)
    gateway.body = stream[:len(stream) - cut] if cut else stream
    t0 = time.monotonic()
    with pytest.raises(RegistryError):
        for ev in gateway.registry.watch_prefix("/kvbridge/", 1, 1000):
            assert ev.kind in ("put", "delete") and isinstance(ev.key, str)
            assert isinstance(ev.value, bytes) and isinstance(ev.revision, int)
            assert isinstance(ev.created, int)
    assert time.monotonic() - t0 < TIMEOUT + SLACK


# --- regressions the fuzzing found -------------------------------------------------------

@pytest.mark.parametrize("clock", [math.nan, math.inf, -math.inf])
def test_a_clock_that_is_not_finite_is_refused(peer, clock):
    """A peer's clock is the clock offset's input (vLLM stamps block expiry times with it):
    NaN or inf made the offset NaN or inf. Refused on vLLM's wire and in a payload
    envelope (the http and etcd methods)."""
    peer.script = _answers(_frames([b"", b"payload", msgspec.msgpack.encode(clock)]))
    with pytest.raises(WireFormatError, match="clock frame .* is not a finite number"):
        VllmZmqClient(TIMEOUT, 1024).fetch_ranks(HOST, peer.port, [(0, 0)])
    for field in ("clock", "wall"):
        env = PayloadEnvelope(payload_schema=PAYLOAD_SCHEMA_VERSION, kind="k", engine_id="e",
                              epoch="x", clock=1.0, wall=2.0, ranks=[])
        data = encode_payload_envelope(msgspec.structs.replace(env, **{field: clock}))
        with pytest.raises(WireFormatError, match="is not a finite number"):
            decode_payload_envelope(data, "k")


def test_a_watch_message_that_is_not_json_ends_the_watch_at_once(gateway):
    """The gateway ends every message with a newline: a line that is not JSON is refused
    at once. It was taken for the start of an unfinished message, so the watch kept
    buffering and heard nothing more, deaf, until the connection closed."""
    put = json.dumps({"result": {"events": [{"kv": {
        "key": _b64(b"/kvbridge/a"), "value": _b64(b"v"), "mod_revision": "7"}}]}}).encode()
    gateway.body = put + b"\n}not json{\n" + put + b"\n"
    gateway.hold = threading.Event()
    seen = []
    try:
        t0 = time.monotonic()
        with pytest.raises(RegistryError, match="not JSON"):
            for ev in gateway.registry.watch_prefix("/kvbridge/", 1, 1000):
                seen.append((ev.kind, ev.key, ev.value, ev.revision))
        assert time.monotonic() - t0 < TIMEOUT + SLACK
    finally:
        gateway.hold.set()
        gateway.hold = None
    assert seen == [("put", "/kvbridge/a", b"v", 7)]
