"""vLLM 0.32's own zmq handshake, spoken with bounds (no vLLM import).

The wire, as vLLM's NixlConnector speaks it (``nixl/base_scheduler.py``
``_nixl_handshake_listener``, ``nixl/base_worker.py`` ``_nixl_handshake``):

* request: one frame, msgpack ``[b"get_meta_msg", pp_rank, tp_rank]`` (a REQ socket, so a
  ROUTER sees ``[identity, b"", request]``);
* reply: two frames, the rank's msgpack-encoded ``NixlHandshakePayload`` and msgpack of the
  serving process's ``time.perf_counter()``.

``VllmZmqServer`` serves it with kvbridge's own ZMTP listener (a request of at most
16 KiB, connections budgeted, one bad peer cannot stop it; vLLM's listener dies on a
malformed request). A rank it does not hold is answered with an empty payload, which a
stock client fails on at once rather than after its 5 s timeout. ``VllmZmqClient`` asks
for every rank on one connection within one deadline and caps the reply's size.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING
from kvbridge.errors import HandshakeTimeout, PeerMismatch, WireFormatError
from kvbridge.guard import ConnectionBudget
from kvbridge.handshake.base import MAX_REQUEST_BYTES, HandshakeServer
from kvbridge.handshake.payloads import FetchedPayloads, Rank
from kvbridge.handshake.zmtp import ZmtpListener
from kvbridge.net import listen_socket

GET_META_MSG = b"get_meta_msg"

_request_decoder = msgspec.msgpack.Decoder(tuple[bytes, int, int])
_clock_decoder = msgspec.msgpack.Decoder(float)
_encoder = msgspec.msgpack.Encoder()


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host.strip('[]')}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class VllmZmqServer(HandshakeServer):
    """Answers vLLM 0.32's ``(GET_META_MSG, pp_rank, tp_rank)`` requests."""

    method = "zmq"

    def __init__(self, payloads: dict[Rank, bytes], host: str, port: int, *,
                 budget: ConnectionBudget | None = None,
                 setting: str = SIDE_CHANNEL_PORT_SETTING):
        """``setting`` names what chose the port, for the error when it cannot be bound."""
        self._payloads: dict[Rank, bytes] = dict(payloads)
        self._sock = listen_socket(host, port, setting)
        self.requests = 0
        self.refused = 0
        self._listener = ZmtpListener(self._sock, self._answer, max_bytes=MAX_REQUEST_BYTES,
                                      budget=budget)

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def set_payloads(self, payloads: dict[Rank, bytes]) -> None:
        """Serve ``payloads`` from now on (a republish: each given rank is replaced). The
        dict is swapped whole, so a request reads either the old or the new one."""
        self._payloads = {**self._payloads, **payloads}

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> None:
        self._listener.stop()
        self._sock.close()

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        # REQ sends [b"", request]; DEALER clients may send the request alone.
        if len(frames) == 2 and frames[0] == b"":
            delim, request = [b""], frames[1]
        elif len(frames) == 1:
            delim, request = [], frames[0]
        else:
            self.refused += 1
            return None  # not vLLM's wire: no answer (as for any malformed message)
        try:
            msg, pp_rank, tp_rank = _request_decoder.decode(request)
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.refused += 1
            return None
        self.requests += 1
        payload = self._payloads.get((pp_rank, tp_rank), b"") if msg == GET_META_MSG else b""
        return [*delim, payload, _encoder.encode(time.perf_counter())]


class VllmZmqClient:
    """Fetches ranks from a vLLM-wire listener (stock vLLM or ``VllmZmqServer``)."""

    method = "zmq"

    def __init__(self, timeout: float, max_message_bytes: int):
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes

    def fetch(self, host: str, port: int, ranks: list[Rank]) -> FetchedPayloads:
        deadline = time.monotonic() + self.timeout
        where = f"zmq://{host}:{port}"
        sock = zmq.Context.instance().socket(zmq.DEALER)
        payloads: dict[Rank, bytes] = {}
        best_rtt, best_offset = float("inf"), 0.0
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # A frame over the limit is dropped by libzmq (the connection with it): no reply.
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(_tcp(host, port))  # zmq retries the connection until the deadline
            for pp_rank, tp_rank in ranks:
                start = time.perf_counter()
                sock.send_multipart([b"", _encoder.encode((GET_META_MSG, pp_rank, tp_rank))])
                left_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
                if not sock.poll(left_ms, zmq.POLLIN):
                    raise HandshakeTimeout(
                        f"zmq handshake with {host}:{port}: no reply within {self.timeout:g}s "
                        f"(peer down, not answering, or reply over {self.max_message_bytes} B)")
                frames = sock.recv_multipart()
                recv = time.perf_counter()
                if len(frames) != 3 or frames[0] != b"":
                    raise WireFormatError(f"{where}: a reply of {len(frames)} frames is not "
                                          "vLLM's (payload, clock)")
                payload, clock = frames[1], frames[2]
                if not payload:
                    raise PeerMismatch(f"{where} has no metadata for pp rank {pp_rank}, "
                                       f"tp rank {tp_rank}")
                try:
                    remote = _clock_decoder.decode(clock)
                except (msgspec.ValidationError, msgspec.DecodeError) as e:
                    raise WireFormatError(f"{where}: malformed clock frame: {e}") from None
                payloads[(pp_rank, tp_rank)] = payload
                # As vLLM: keep the lowest round trip's midpoint estimate.
                if recv - start < best_rtt:
                    best_rtt, best_offset = recv - start, remote - (start + recv) / 2
        finally:
            sock.close(linger=0)
        return FetchedPayloads(engine_id="", epoch="", payloads=payloads,
                               clock_offset=best_offset)
