"""The ``zmq`` method: a ROUTER listener and a DEALER client speaking msgpack.

Request: ``ZmqRequest`` (schema version, token, tp_rank or None for all ranks).
Reply: ``ZmqReply`` (HTTP-style status, error text, envelope bytes). The
envelope is the same as over http. ZMQ here has no TLS: see docs/security.md. The server
speaks ZMTP itself (``_zmtp``) to bound what one peer's message can make it hold.
"""

from __future__ import annotations

import logging
import socket
import time

import msgspec
import zmq

from kvbridge.errors import HandshakeTimeout, WireFormatError
from kvbridge.guard import ConnectionBudget
from kvbridge.handshake._zmtp import ZmtpListener
from kvbridge.handshake.base import (
    MAX_REQUEST_BYTES,
    HandshakeClient,
    HandshakeServer,
    MetadataStore,
    Observer,
    Reply,
    token_ok,
)
from kvbridge.metadata import SCHEMA_VERSION

log = logging.getLogger(__name__)


class ZmqRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    schema_version: int
    token: str | None
    tp_rank: int | None


class ZmqReply(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    status: int
    error: str
    envelope: bytes


_req_decoder = msgspec.msgpack.Decoder(ZmqRequest)
_reply_decoder = msgspec.msgpack.Decoder(ZmqReply)
_encoder = msgspec.msgpack.Encoder()


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host.strip('[]')}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ZmqHandshakeServer(HandshakeServer):
    """Answers DEALER/REQ clients with our own ZMTP listener (``_zmtp``) rather than a
    libzmq ROUTER: libzmq does not bound how many frames a message has."""

    method = "zmq"

    def __init__(self, store: MetadataStore, host: str, port: int, *, token: str | None = None,
                 observer: Observer | None = None, budget: ConnectionBudget | None = None):
        self._store = store
        self._observer = observer
        self._token = token
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
            self._sock.listen(2048)
        except OSError:
            self._sock.close()
            raise
        self._port = self._sock.getsockname()[1]
        # A request is a delimiter and a payload of at most MAX_REQUEST_BYTES.
        self._listener = ZmtpListener(self._sock, self._answer,
                                      max_bytes=MAX_REQUEST_BYTES, budget=budget)

    @property
    def port(self) -> int:
        return self._port

    @property
    def dropped(self) -> int:
        """Peers dropped for a message over the size or frame limit."""
        return self._listener.dropped

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()
        self._sock.close()

    def handle(self, payload: bytes) -> ZmqReply:
        try:
            req = _req_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return ZmqReply(400, f"malformed request: {e}", b"")
        if not token_ok(self._token, req.token):  # first: strangers learn nothing, not even
            return ZmqReply(401, "missing or invalid token", b"")  # our schema version
        if req.schema_version != SCHEMA_VERSION:
            return ZmqReply(400, f"request schema v{req.schema_version}, server speaks "
                                 f"v{SCHEMA_VERSION}", b"")
        reply = self._store.reply(req.tp_rank)
        return ZmqReply(reply.status, reply.error, reply.body)

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        # DEALER/REQ clients send [empty delimiter, payload]; anything else is malformed.
        payload = frames[-1] if frames else b""
        delim = [b""] if len(frames) == 2 and frames[0] == b"" else []
        well_formed = len(frames) == 1 or (len(frames) == 2 and frames[0] == b"")
        try:
            reply = self.handle(payload) if well_formed else ZmqReply(
                400, "malformed request: unexpected frames", b"")
            out = [*delim, _encoder.encode(reply)]
            if self._observer is not None:
                self._observer("handshake", reply.status, len(reply.envelope))
            return out
        except Exception:  # one bad peer must not stop the side channel
            log.exception("side channel: failed to answer a request")
            return None


class ZmqHandshakeClient(HandshakeClient):
    method = "zmq"

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Replies over the limit are dropped by libzmq; they then look like no reply.
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes + 1024)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(_tcp(host, port))  # zmq reconnects by itself until the deadline
            sock.send_multipart([b"", _encoder.encode(
                ZmqRequest(SCHEMA_VERSION, self.token, tp_rank))])
            left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not sock.poll(left_ms, zmq.POLLIN):
                raise HandshakeTimeout(
                    f"zmq handshake with {host}:{port}: no reply within {self.timeout:g}s "
                    f"(peer down, not answering, or reply over {self.max_message_bytes} bytes)")
            frames = sock.recv_multipart()
        finally:
            sock.close(linger=0)
        try:
            reply = _reply_decoder.decode(frames[-1])
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise WireFormatError(f"zmq://{host}:{port}: malformed reply: {e}") from None
        if len(reply.envelope) > self.max_message_bytes:
            raise WireFormatError(f"zmq://{host}:{port}: reply exceeds {self.max_message_bytes} B")
        return Reply(reply.status, reply.envelope, reply.error)
