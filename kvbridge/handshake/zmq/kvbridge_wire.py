"""The ``zmq`` method: a ROUTER listener and a DEALER client speaking msgpack.

Request: ``ZmqRequest`` (schema version, token, tp_rank or None for all ranks).
Reply: ``ZmqReply`` (HTTP-style status, error text, envelope bytes). The
envelope is the same as over http. ZMQ here has no TLS: see docs/security.md. Both ends
speak ZMTP themselves (``kvbridge.handshake.zmq.zmtp``, ``dealer``) to bound what a peer's
message can make them hold: a request of at most ``MAX_REQUEST_BYTES``, a reply of at most
``max_message_bytes`` plus ``REPLY_OVERHEAD``, ``MAX_FRAMES`` frames either way.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import msgspec

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING
from kvbridge.errors import HandshakeTimeout, WireFormatError
from kvbridge.guard import ConnectionBudget
from kvbridge.handshake.base import (
    MAX_REQUEST_BYTES,
    HandshakeClient,
    HandshakeServer,
    MetadataStore,
    Observer,
    Reply,
    token_ok,
)
from kvbridge.handshake.zmq.dealer import zmtp_request
from kvbridge.handshake.zmq.zmtp import MAX_FRAMES, ZmtpListener
from kvbridge.metadata import SCHEMA_VERSION
from kvbridge.net import listen_socket

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


# Room in a reply for its status, error text and msgpack framing around the envelope.
REPLY_OVERHEAD = 1024


class ZmqHandshakeServer(HandshakeServer):
    """Answers DEALER/REQ clients with our own ZMTP listener (``ZmtpListener``) rather than
    a libzmq ROUTER: libzmq does not bound how many frames a message has."""

    method = "zmq"

    def __init__(self, store: MetadataStore, host: str, port: int, *, token: str | None = None,
                 observer: Observer | None = None, budget: ConnectionBudget | None = None,
                 setting: str = SIDE_CHANNEL_PORT_SETTING, sock: socket.socket | None = None):
        """``setting`` names what chose the port, for the error when it cannot be bound.
        ``sock``: a listening socket to serve instead (``host`` and ``port`` unused)."""
        self._store = store
        self._observer = observer
        self._token = token
        self._sock = listen_socket(host, port, setting) if sock is None else sock
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

    @property
    def wrong_type(self) -> int:
        """Peers refused for a socket type other than REQ or DEALER."""
        return self._listener.wrong_type

    def start(self) -> None:
        self._listener.start()

    def when_responsive(self, fn: Callable[[], None]) -> None:
        self._listener.call_soon(fn)

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
    """A DEALER over ``zmtp_request``: one connection per fetch, the reply bounded in frames
    (``MAX_FRAMES``) and bytes (``max_message_bytes`` + ``REPLY_OVERHEAD``) as it arrives."""

    method = "zmq"

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        where = f"zmq://{host}:{port}"
        request = _encoder.encode(ZmqRequest(SCHEMA_VERSION, self.token, tp_rank))
        try:
            frames = zmtp_request(host, port, [b"", request], deadline=deadline,
                                  max_bytes=self.max_message_bytes + REPLY_OVERHEAD,
                                  max_frames=MAX_FRAMES, where=where,
                                  limit_name=f"max_message_bytes {self.max_message_bytes} + "
                                             f"{REPLY_OVERHEAD} for the reply's framing")
        except HandshakeTimeout as e:
            raise HandshakeTimeout(f"zmq handshake with {host}:{port}: not complete within "
                                   f"{self.timeout:g}s ({e})") from None
        try:
            reply = _reply_decoder.decode(frames[-1])
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise WireFormatError(f"{where}: malformed reply: {e}") from None
        if len(reply.envelope) > self.max_message_bytes:
            raise WireFormatError(f"{where}: reply exceeds {self.max_message_bytes} B")
        return Reply(reply.status, reply.envelope, reply.error)
