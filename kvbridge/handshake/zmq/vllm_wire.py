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
for every rank on one connection within one deadline, each reply capped in frames and bytes
as it arrives (its own ZMTP, ``kvbridge.handshake.zmq.dealer``).

``kvbridge.handshake.factory`` builds both for ``wire="vllm"`` (the plug-in's ``zmq``
method): the settings (budget, keep-alive, ``handshake_timeout``, ``max_message_bytes``)
reach them there, as they reach ``kvbridge serve``'s zmq method.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable

import msgspec

from kvbridge.config import SIDE_CHANNEL_PORT_SETTING
from kvbridge.errors import (
    ConfigError,
    HandshakeTimeout,
    PeerMismatch,
    RetryableHandshakeError,
    WireFormatError,
)
from kvbridge.guard import ConnectionBudget
from kvbridge.handshake.base import (
    MAX_REQUEST_BYTES,
    FetchedPayloads,
    HandshakeClient,
    HandshakeServer,
    Rank,
    Reply,
)
from kvbridge.handshake.zmq.dealer import ZmtpDealer
from kvbridge.handshake.zmq.zmtp import ZmtpListener
from kvbridge.net import listen_socket

GET_META_MSG = b"get_meta_msg"
# A reply as a DEALER reads it: the empty delimiter, the payload, the clock.
REPLY_FRAMES = 3
# Room beyond ``max_message_bytes`` for the clock frame (msgpack float64: 9 bytes).
CLOCK_ROOM = 16

_request_decoder = msgspec.msgpack.Decoder(tuple[bytes, int, int])
_clock_decoder = msgspec.msgpack.Decoder(float)
_encoder = msgspec.msgpack.Encoder()


class VllmZmqServer(HandshakeServer):
    """Answers vLLM 0.32's ``(GET_META_MSG, pp_rank, tp_rank)`` requests."""

    method = "zmq"

    def __init__(self, payloads: dict[Rank, bytes], host: str, port: int, *,
                 budget: ConnectionBudget | None = None,
                 setting: str = SIDE_CHANNEL_PORT_SETTING, sock: socket.socket | None = None):
        """``setting`` names what chose the port, for the error when it cannot be bound.
        ``sock``: a listening socket to serve instead (``host`` and ``port`` unused)."""
        self._payloads: dict[Rank, bytes] = dict(payloads)
        self._sock = listen_socket(host, port, setting) if sock is None else sock
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

    def payloads_changed(self, payloads: dict[Rank, bytes]) -> None:
        self.set_payloads(payloads)  # served from its own dict, not from the store

    def start(self) -> None:
        self._listener.start()

    def when_responsive(self, fn: Callable[[], None]) -> None:
        self._listener.call_soon(fn)

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


class VllmZmqClient(HandshakeClient):
    """Fetches ranks from a vLLM-wire listener (stock vLLM or ``VllmZmqServer``): vLLM's
    own payloads, so ``fetch_payloads`` only (there is no kvbridge envelope, no kind, no
    engine id or epoch on this wire, and no token).

    Speaks ZMTP itself (``ZmtpDealer``) rather than through libzmq, whose ``MAXMSGSIZE``
    caps one frame but not how many: each reply is refused at its 4th frame or past
    ``max_message_bytes`` (+ ``CLOCK_ROOM`` for the clock frame), before the frame over
    the limit is read. A refused or dropped connection is tried again until the deadline
    (a peer starting or restarting), the ranks already answered kept.
    """

    method = "zmq"

    def __init__(self, timeout: float, max_message_bytes: int):
        super().__init__(timeout, None, None, max_message_bytes)

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        raise WireFormatError(f"zmq://{host}:{port} speaks vLLM's wire: per-rank payloads "
                              "only (fetch_payloads), no kvbridge envelope")

    def fetch_payloads(self, kind: str, host: str, port: int, ranks: list[Rank], *,
                       expected_engine_id: str | None = None) -> FetchedPayloads:
        """``fetch_ranks`` (``kind`` and ``expected_engine_id``: not on this wire; vLLM
        checks the payloads it gets)."""
        return self.fetch_ranks(host, port, ranks)

    def fetch_ranks(self, host: str, port: int, ranks: list[Rank]) -> FetchedPayloads:
        """Every rank of ``ranks`` on one connection within one deadline."""
        deadline = time.monotonic() + self.timeout
        where = f"zmq://{host}:{port}"
        payloads: dict[Rank, bytes] = {}
        clock = _Clock()
        delay = 0.02
        while True:
            try:
                with ZmtpDealer(host, port, deadline=deadline, where=where,
                                limit_name=f"max_message_bytes {self.max_message_bytes} + "
                                           f"{CLOCK_ROOM} for the clock frame") as dealer:
                    for rank in ranks:
                        if rank not in payloads:
                            payloads[rank] = self._ask(dealer, rank, clock)
                break
            except RetryableHandshakeError as e:
                left = deadline - time.monotonic()
                if left > 0:
                    time.sleep(min(delay, left))
                delay = min(delay * 2, 0.5)
                if time.monotonic() >= deadline:
                    raise HandshakeTimeout(f"zmq handshake with {host}:{port} gave up after "
                                           f"{self.timeout:g}s: {e}") from None
            except HandshakeTimeout as e:
                raise HandshakeTimeout(f"zmq handshake with {host}:{port}: not complete "
                                       f"within {self.timeout:g}s ({e})") from None
        return FetchedPayloads(engine_id="", epoch="", payloads={r: payloads[r] for r in ranks},
                               clock_offset=clock.offset)

    def _ask(self, dealer: ZmtpDealer, rank: Rank, clock: _Clock) -> bytes:
        pp_rank, tp_rank = rank
        start = time.perf_counter()
        frames = dealer.request([b"", _encoder.encode((GET_META_MSG, pp_rank, tp_rank))],
                                max_bytes=self.max_message_bytes + CLOCK_ROOM,
                                max_frames=REPLY_FRAMES)
        recv = time.perf_counter()
        if len(frames) != REPLY_FRAMES or frames[0] != b"":
            raise WireFormatError(f"{dealer.where}: a reply of {len(frames)} frames is not "
                                  "vLLM's (payload, clock)")
        payload, clock_frame = frames[1], frames[2]
        if not payload:
            raise PeerMismatch(f"{dealer.where} has no metadata for pp rank {pp_rank}, "
                               f"tp rank {tp_rank}")
        if len(payload) > self.max_message_bytes:
            raise WireFormatError(f"{dealer.where}: a payload of {len(payload)} bytes, over "
                                  f"the limit of max_message_bytes {self.max_message_bytes}")
        try:
            remote = _clock_decoder.decode(clock_frame)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise WireFormatError(f"{dealer.where}: malformed clock frame: {e}") from None
        if not math.isfinite(remote):  # NaN or inf would make every expiry time NaN or inf
            raise WireFormatError(f"{dealer.where}: clock frame {remote!r} is not a finite "
                                  "number")
        clock.sample(start, recv, remote)
        return payload


def no_token(token: str | None) -> None:
    """Refuse a token for vLLM's wire, which has no place for one."""
    if token:  # load_settings refuses it first; never let a token be dropped silently
        raise ConfigError("kvbridge.vllm: the zmq method speaks vLLM's own wire, which has "
                          "no place for a side-channel token: use handshake_method 'http'")


class _Clock:
    """As vLLM: the lowest round trip's midpoint estimate of the peer's clock offset."""

    def __init__(self) -> None:
        self.rtt, self.offset = float("inf"), 0.0

    def sample(self, start: float, recv: float, remote: float) -> None:
        if recv - start < self.rtt:
            self.rtt, self.offset = recv - start, remote - (start + recv) / 2
