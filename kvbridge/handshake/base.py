"""The handshake strategy interface, shared by the ``zmq`` and ``http`` methods.

Server side: a ``MetadataStore`` holds every rank's metadata of this instance
(the head process fills it from its workers) and a ``HandshakeServer`` serves it
from one port. Client side: a ``HandshakeClient`` fetches one rank (or all) of a
peer within a deadline, retrying connection errors with backoff, and returns
verified ``RankMetadata``.
"""

from __future__ import annotations

import hmac
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.errors import (
    AuthError,
    HandshakeError,
    HandshakeTimeout,
    PeerMismatch,
    RetryableHandshakeError,
    UntrustedSideChannel,
    WireFormatError,
)
from kvbridge.metadata import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Compat,
    RankMetadata,
    decode_envelope,
    decode_payload_envelope,
    encode_envelope,
    to_jsonable,
)
from kvbridge.trust import SideChannelTrust

# Called once per answered request: (route, status, body bytes). How the side channel
# reports to metrics without knowing about them.
Observer = Callable[[str, int, int], None]

Rank = tuple[int, int]  # (pp_rank, tp_rank)

# Largest request a side channel accepts: requests carry a rank and a token only.
MAX_REQUEST_BYTES = 16 * 1024


@dataclass(frozen=True)
class Reply:
    """A server's answer, independent of the transport (HTTP-style status codes)."""

    status: int
    body: bytes = b""
    error: str = ""


class MetadataStore:
    """Every rank's metadata of this instance, and the encoded replies to serve.

    Thread-safe; replies are encoded once per change, not per request.
    """

    def __init__(self, compat: Compat, tp_size: int):
        self.compat = compat
        self.tp_size = tp_size
        # Where each rank lives (multi-node instances): shown in the JSON view only.
        self.rank_hosts: dict[int, str] = {}
        # None while the instance can serve, else why not (e.g. one of its nodes is gone):
        # the side channel then answers 503 and is not ready.
        self.health: Callable[[], str | None] | None = None
        self._ranks: dict[int, RankMetadata] = {}
        self._lock = threading.Lock()
        self._encoded: dict[int | None, bytes] = {}

    def __getstate__(self) -> dict:
        # What a side-channel process needs (kvbridge.handshake.process.control): not the lock, and
        # not ``health``, a callable of the parent (it forwards the answers instead).
        state = self.__dict__.copy()
        del state["_lock"]
        state["health"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def set_rank(self, meta: RankMetadata) -> None:
        if not 0 <= meta.tp_rank < self.tp_size or meta.tp_size != self.tp_size:
            raise ValueError(f"rank {meta.tp_rank}/{meta.tp_size} does not fit tp_size "
                             f"{self.tp_size}")
        with self._lock:
            self._ranks[meta.tp_rank] = meta
            self._encoded.clear()

    @property
    def ready(self) -> bool:
        with self._lock:
            if len(self._ranks) != self.tp_size:
                return False
        return self.health is None or self.health() is None

    def reply(self, tp_rank: int | None) -> Reply:
        if self.health is not None and (why := self.health()) is not None:
            return Reply(503, error=f"not ready: {why}")
        with self._lock:
            if len(self._ranks) < self.tp_size:
                return Reply(503, error=f"metadata of {len(self._ranks)}/{self.tp_size} "
                                        "ranks in; not ready")
            if tp_rank is not None and not 0 <= tp_rank < self.tp_size:
                return Reply(404, error=f"no tp_rank {tp_rank}: tp_size is {self.tp_size}")
            if tp_rank not in self._encoded:
                ranks = ([self._ranks[tp_rank]] if tp_rank is not None
                         else [self._ranks[r] for r in range(self.tp_size)])
                self._encoded[tp_rank] = encode_envelope(self.compat, ranks)
            return Reply(200, self._encoded[tp_rank])

    def json_view(self, tp_rank: int | None) -> dict:
        with self._lock:
            ranks = ([self._ranks[tp_rank]] if tp_rank is not None
                     else [self._ranks[r] for r in sorted(self._ranks)])
        view = to_jsonable(ranks, self.compat)
        for rank in view["ranks"]:
            host = self.rank_hosts.get(rank["tp_rank"])
            if host is not None:
                rank["host"] = host
        return view


def token_ok(expected: str | None, given: str | None) -> bool:
    """Constant-time comparison; no token configured accepts anything."""
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


class HandshakeServer(ABC):
    """Serves a ``MetadataStore`` on one port until ``stop``."""

    method: str

    @property
    @abstractmethod
    def port(self) -> int: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    def health_changed(self) -> None:
        """The instance's health may have changed: for servers that are told rather than
        ask (a side-channel process)."""
        return None

    def payloads_changed(self, payloads: dict[tuple[int, int], bytes]) -> None:
        """The store's payloads changed to ``payloads`` (a republish): for servers that
        serve more than the store (etcd's record, vLLM's wire)."""
        return None

    def when_responsive(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` from the event loop that serves, when it gets to it: how a liveness
        ping is answered (a loop that is stuck or flooded answers late or never). At once
        for a server with no loop of its own."""
        fn()

    def __enter__(self) -> HandshakeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class FetchedPayloads:
    """What a peer answered: its payloads by (pp_rank, tp_rank), who it is, and the
    estimated offset of its ``perf_counter`` to ours (theirs - ours, seconds)."""

    engine_id: str
    epoch: str
    payloads: dict[Rank, bytes]
    clock_offset: float


class HandshakeClient(ABC):
    """Fetches a peer's metadata; the transport is the subclass's business."""

    method: str
    records_lag = False  # True where a stored record can be older than its instance (etcd)

    def __init__(self, timeout: float, expected: Compat | None, token: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, *,
                 trusted: SideChannelTrust | None = None):
        """``trusted``: the side channels the token may be presented to (None: any, the
        caller picks every host; ``make_client`` passes ``trusted_side_channels``)."""
        self.timeout = timeout
        self.expected = expected
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.trusted = trusted

    @abstractmethod
    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        """One attempt; raise ``RetryableHandshakeError`` for transient transport errors, ``HandshakeTimeout``
        when the deadline passes."""

    def close(self) -> None:
        """Release pooled connections."""
        return None

    def fetch(self, host: str, port: int, tp_rank: int | None = None) -> list[RankMetadata]:
        """The peer's metadata for ``tp_rank`` (all ranks when None), verified.

        Bounded by ``timeout`` in total, whatever the peer does.
        """
        body = self.fetch_body(host, port, tp_rank)
        where = f"{self.method}://{host}:{port}"
        try:
            ranks = decode_envelope(body, self.expected, self.max_message_bytes)
        except WireFormatError as e:
            raise WireFormatError(f"{where}: {e}") from None
        if tp_rank is not None and [r.tp_rank for r in ranks] != [tp_rank]:
            raise WireFormatError(f"{where} answered ranks {[r.tp_rank for r in ranks]} "
                                  f"when asked for rank {tp_rank}")
        return ranks

    def fetch_body(self, host: str, port: int, tp_rank: int | None = None,
                   deadline: float | None = None) -> bytes:
        """The peer's reply body for ``tp_rank`` (all ranks when None), not decoded: for
        callers that carry another envelope (``PayloadStore``). Retries transport errors
        until ``deadline`` (``time.monotonic()``; default ``timeout`` from now); a refusal
        raises ``AuthError``, ``PeerMismatch`` or ``HandshakeError``."""
        if self.token and self.trusted is not None and not self.trusted.allows(host, port):
            raise UntrustedSideChannel(
                f"{self.method}://{host}:{port} is not a side channel this instance presents "
                "its token to (trusted_side_channels): not fetched")
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        delay = 0.02
        while True:
            try:
                reply = self._request(host, port, tp_rank, deadline)
                break
            except RetryableHandshakeError as e:
                left = deadline - time.monotonic()
                if left > 0:
                    time.sleep(min(delay, left))
                if time.monotonic() >= deadline:  # say why, rather than "no time left"
                    raise HandshakeTimeout(
                        f"{self.method} handshake with {host}:{port} gave up after "
                        f"{self.timeout:g}s: {e}") from None
                delay = min(delay * 2, 0.5)
        where = f"{self.method}://{host}:{port}"
        if reply.status == 401:
            raise AuthError(f"{where} refused our credentials: {reply.error}")
        if reply.status == 404:  # no such rank: the peer is not the instance we were told of
            raise PeerMismatch(f"{where} answered 404: {reply.error}")
        if reply.status != 200:
            raise HandshakeError(f"{where} answered {reply.status}: {reply.error}")
        return reply.body

    def fetch_payloads(self, kind: str, host: str, port: int, ranks: list[Rank], *,
                       expected_engine_id: str | None = None) -> FetchedPayloads:
        """Opaque payloads (``kind``, a ``PayloadStore``'s) of ``ranks`` of the peer at
        ``host:port``, within ``timeout`` in total.

        One request when every rank is in one tensor rank (any pipeline stage), else one
        for all. Where a record can lag its instance (``records_lag``: etcd), a reply from
        another engine id than ``expected_engine_id`` is asked again until the deadline.
        """
        deadline = time.monotonic() + self.timeout
        tps = {tp for _, tp in ranks}
        tp_rank = next(iter(tps)) if len(tps) == 1 else None
        where = f"{self.method}://{host}:{port}"
        while True:
            start = time.perf_counter()
            body = self.fetch_body(host, port, tp_rank, deadline=deadline)
            recv = time.perf_counter()
            env = decode_payload_envelope(body, kind, self.max_message_bytes)
            if (self.records_lag and expected_engine_id is not None
                    and env.engine_id != expected_engine_id and time.monotonic() < deadline):
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                continue
            break
        got = {(r.pp_rank, r.tp_rank): r.payload for r in env.ranks}
        missing = [r for r in ranks if r not in got]
        if missing:
            raise PeerMismatch(f"{where} has no metadata for ranks {missing} (pp, tp): it "
                               f"serves {sorted(got)}")
        # A reply encoded per request (http): the peer's clock at our round trip's midpoint.
        # A stored one (etcd): its clock advanced by the wall time since it was encoded.
        age = max(0.0, time.time() - env.wall) if self.records_lag else 0.0
        offset = env.clock + age - (start + recv) / 2
        return FetchedPayloads(env.engine_id, env.epoch, {r: got[r] for r in ranks}, offset)
