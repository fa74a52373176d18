"""The zmq side channel's own ZMTP: libzmq clients still work with the listener, a peer whose
message passes the frame or size limit is dropped, a peer of another socket type refused; the
client stops reading a reply at the same kind of limit."""

from __future__ import annotations

import logging
import struct
import time

import msgspec
import pytest
import zmq

from kvbridge.errors import WireFormatError
from kvbridge.handshake.base import MAX_REQUEST_BYTES
from kvbridge.handshake.zmq.kvbridge_wire import (
    ZmqHandshakeClient,
    ZmqHandshakeServer,
    ZmqReply,
    ZmqRequest,
)
from kvbridge.metadata import SCHEMA_VERSION
from tests import zmtp_raw
from tests.helpers import compat, full_store, rank_meta, wait_until

HOST = "127.0.0.1"
TOKEN = "zmtp-token"


def _server() -> ZmqHandshakeServer:
    server = ZmqHandshakeServer(full_store(2), HOST, 0, token=TOKEN)
    server.start()
    return server


def _ok(server: ZmqHandshakeServer) -> None:
    assert ZmqHandshakeClient(10, compat(), TOKEN).fetch(HOST, server.port) == [
        rank_meta(0),
        rank_meta(1),
    ]


def test_endless_message_is_dropped_and_the_server_still_answers():
    server = _server()
    try:
        s = zmtp_raw.connect(HOST, server.port)
        sent = zmtp_raw.send_until_closed(s, 16 * 1024, 20_000)
        s.close()
        # dropped at the limit: what was sent fits in the socket buffers, not 320 MB
        assert sent < 2000
        assert server.dropped == 1
        _ok(server)
    finally:
        server.stop()


def test_too_many_frames_or_bytes_are_dropped():
    server = _server()
    ctx = zmq.Context.instance()
    try:
        for n, frames in enumerate(([b""] * 9, [b"", b"\x00" * (MAX_REQUEST_BYTES + 1)]), 1):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{HOST}:{server.port}")
            sock.send_multipart(frames)
            # The server says it dropped the peer (a slow server is not mistaken for it) ...
            wait_until(lambda n=n: server.dropped == n, 30, f"peer {n} dropped")
            assert not sock.poll(0)  # ... and it never answered
            sock.close(linger=0)
        # 8 frames is within the limit: answered (400, not a request)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{server.port}")
        sock.send_multipart([b"x"] * 8)
        assert sock.poll(10_000)
        assert msgspec.msgpack.decode(sock.recv_multipart()[-1], type=ZmqReply).status == 400
        sock.close(linger=0)
        _ok(server)
    finally:
        server.stop()


def test_req_client_and_pipelined_dealer_requests():
    server = _server()
    ctx = zmq.Context.instance()
    try:
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://{HOST}:{server.port}")
        for _ in range(3):
            req.send(msgspec.msgpack.encode(ZmqRequest(SCHEMA_VERSION, TOKEN, 1)))
            assert req.poll(10_000)
            assert msgspec.msgpack.decode(req.recv(), type=ZmqReply).status == 200
        req.close(linger=0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{HOST}:{server.port}")
        for rank in (0, 1, 0, 5):
            dealer.send_multipart(
                [b"", msgspec.msgpack.encode(ZmqRequest(SCHEMA_VERSION, TOKEN, rank))]
            )
        got = []
        for _ in range(4):
            assert dealer.poll(10_000)
            got.append(msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=ZmqReply).status)
        assert got == [200, 200, 200, 404]
        dealer.close(linger=0)
    finally:
        server.stop()


# --- the client: a peer's reply is bounded as the listener bounds requests -----------------

@pytest.mark.parametrize("frame_bytes,limit", [(16, "8 frames"), (4096, "8 frames"),
                                               (60_000, r"bytes \(max_message_bytes 100000")])
def test_client_stops_an_endless_multi_frame_reply(frame_bytes, limit):
    sent: list[int] = []
    with zmtp_raw.streaming_router(zmtp_raw.frame(b"\x00" * frame_bytes, more=True), sent) as srv:
        client = ZmqHandshakeClient(30, compat(), TOKEN, max_message_bytes=100_000)
        t0 = time.monotonic()
        with pytest.raises(WireFormatError, match=f"zmq://{HOST}:{srv.port}: reply .*{limit}"):
            client.fetch(HOST, srv.port)
        assert time.monotonic() - t0 < 30 / 2  # at the limit, not at the deadline
        wait_until(lambda: sent, 10, "the server to see the client go")
    # the client closed at the limit: what went out fits in the socket buffers, not 100k frames
    assert sent[0] < 100_000


def test_client_refuses_a_frame_over_the_limit_before_reading_it():
    sent: list[int] = []
    # one frame that declares 2**40 bytes: nothing of it is read, let alone held
    declared = bytes([0x02]) + struct.pack(">Q", 2**40)
    with zmtp_raw.streaming_router(declared, sent, max_frames=1) as srv:
        client = ZmqHandshakeClient(30, compat(), TOKEN, max_message_bytes=100_000)
        with pytest.raises(WireFormatError, match="over the limit of 101024 bytes"):
            client.fetch(HOST, srv.port)


def test_client_still_reads_a_reply_of_the_largest_size():
    store = full_store(1, agent_metadata=b"m" * 60_000)
    size = len(store.reply(None).body)
    server = ZmqHandshakeServer(store, HOST, 0, token=TOKEN)
    server.start()
    try:
        assert len(ZmqHandshakeClient(10, compat(), TOKEN, max_message_bytes=size)
                   .fetch(HOST, server.port)) == 1
    finally:
        server.stop()


# --- the listener: only REQ and DEALER peers -----------------------------------------------

@pytest.mark.parametrize("kind", [b"PUB", b"SUB", b"ROUTER", b"PUSH", b""])
def test_listener_refuses_other_socket_types_and_keeps_serving(kind, caplog):
    server = _server()
    try:
        with caplog.at_level(logging.WARNING, logger="kvbridge.handshake.zmq.zmtp"), \
                zmtp_raw.connect(HOST, server.port, timeout=10, socket_type=kind) as s:
            zmtp_raw.recv_exactly(s, 64)  # our greeting
            s.sendall(zmtp_raw.frame(b"", more=True) + zmtp_raw.frame(b"payload"))
            # refused: the connection closes with no reply (READY aside)
            rest = b""
            try:
                while chunk := s.recv(65536):
                    rest += chunk
            except ConnectionResetError:  # closed with unread data: a reset, not a FIN
                pass
            assert b"payload" not in rest and len(rest) < 64
        assert server.wrong_type == 1
        assert server.dropped == 0
        line = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(line) == 1 and "REQ or DEALER" in line[0], line
        assert (f"socket type {kind.decode()!r}" if kind else "(none)") in line[0]
        _ok(server)
    finally:
        server.stop()


def test_listener_refuses_a_libzmq_push_socket():
    server = _server()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://{HOST}:{server.port}")
        wait_until(lambda: server.wrong_type >= 1, 10, "the PUSH socket to be refused")
        _ok(server)
    finally:
        push.close(linger=0)
        server.stop()
