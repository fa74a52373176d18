"""The zmq side channel's own ZMTP listener: libzmq clients still work, and a peer whose
message passes the frame or size limit is dropped."""

from __future__ import annotations

import msgspec
import zmq

from kvbridge.handshake.base import MAX_REQUEST_BYTES
from kvbridge.handshake.zmq import ZmqHandshakeClient, ZmqHandshakeServer, ZmqReply, ZmqRequest
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
