"""The zmq side channels' client: a ZMTP 3.0 DEALER spoken by hand (``ZmtpDealer``), every
reply bounded as ``ZmtpListener`` bounds requests, and ``zmtp_request`` for one request.

A reply of more than ``max_frames`` frames or ``max_bytes`` bytes in all is refused before
the frame over the limit is read (libzmq's ``ZMQ_MAXMSGSIZE`` caps one frame, not how many
a message has): what a peer can make the client hold is bounded by the limits, not by how
long it keeps sending. Every read and write is bounded by one deadline.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from types import TracebackType

from kvbridge.errors import HandshakeTimeout, RetryableHandshakeError, WireFormatError
from kvbridge.handshake.zmq.zmtp import (
    _COMMAND,
    _GREETING,
    _LONG,
    _MORE,
    MAX_FRAMES,
    _command,
    _frame,
    ready_properties,
)

# The socket types a DEALER may talk to (ZMTP 3.0).
SERVER_TYPES = frozenset({"ROUTER", "DEALER", "REP"})
# A READY command, or a command between messages (PING): small, whatever the reply limits.
_MAX_COMMAND_BYTES = 4096


@contextlib.contextmanager
def _transport_errors(where: str) -> Iterator[None]:
    """Socket failures as the handshake's errors: a passed deadline is ``HandshakeTimeout``;
    a connection closed or reset is ``RetryableHandshakeError`` (the peer may be restarting)."""
    try:
        yield
    except TimeoutError:
        raise HandshakeTimeout(f"{where}: no reply within the deadline") from None
    except (ConnectionError, EOFError) as e:
        raise RetryableHandshakeError(
            f"{where}: connection closed before the reply ({type(e).__name__})") from None
    except OSError as e:
        raise RetryableHandshakeError(f"{where}: {type(e).__name__}: {e}") from None


class ZmtpDealer:
    """One connection to a ROUTER (or REP, DEALER) at ``host:port``: requests sent one at a
    time, each reply read within ``deadline`` (``time.monotonic()``, for the connection's
    whole life) and bounded by the request's limits.

    Connecting raises ``HandshakeTimeout`` past the deadline and ``RetryableHandshakeError``
    when refused or unreachable; a peer that is not a ZMTP 3 router is a ``WireFormatError``.
    ``limit_name`` says in the errors where ``max_bytes`` comes from.
    """

    def __init__(self, host: str, port: int, *, deadline: float, where: str | None = None,
                 limit_name: str = "") -> None:
        self.where = where or f"zmq://{host}:{port}"
        self.deadline = deadline
        self.limit_name = f" ({limit_name})" if limit_name else ""
        self._ready_checked = False
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeout(f"{self.where}: no time left for the handshake")
        try:
            self.sock = socket.create_connection((host.strip("[]"), port), timeout=left)
        except TimeoutError:
            raise HandshakeTimeout(f"{self.where}: no connection within the deadline") from None
        except OSError as e:  # refused, unreachable, no such name (yet)
            raise RetryableHandshakeError(f"{self.where}: {type(e).__name__}: {e}") from None
        try:
            with _transport_errors(self.where):
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._send(_GREETING)
                peer = self._recv(64)
            if peer[0] != 0xFF or peer[9] != 0x7F or peer[10] < 3:
                raise WireFormatError(f"{self.where}: not a ZMTP 3 peer")
            if peer[12:32].rstrip(b"\x00") != b"NULL":
                raise WireFormatError(f"{self.where}: security mechanism other than NULL")
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self) -> ZmtpDealer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def request(self, frames: list[bytes], *, max_bytes: int,
                max_frames: int = MAX_FRAMES) -> list[bytes]:
        """Send one multipart message and return the reply's frames. More than ``max_frames``
        frames or ``max_bytes`` bytes in all is a ``WireFormatError`` naming the limit."""
        message = b"".join(_frame(f, _MORE) for f in frames[:-1]) + _frame(frames[-1])
        with _transport_errors(self.where):
            if not self._ready_checked:  # our READY goes with the first request
                message = _command(b"READY", {b"Socket-Type": b"DEALER"}) + message
            self._send(message)
            if not self._ready_checked:
                self._check_ready()
                self._ready_checked = True
            return self._reply(max_bytes, max_frames)

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError
            got += k
        return bytes(buf)

    def _send(self, data: bytes) -> None:
        self.sock.settimeout(max(self.deadline - time.monotonic(), 0.001))
        self.sock.sendall(data)

    def _frame_head(self) -> tuple[int, int]:
        (flags,) = self._recv(1)
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise WireFormatError(f"{self.where}: bad ZMTP frame flags {flags:#x}")
        if flags & _LONG:
            (size,) = struct.unpack(">Q", self._recv(8))
        else:
            (size,) = self._recv(1)
        return flags, size

    def _check_ready(self) -> None:
        flags, size = self._frame_head()
        if not flags & _COMMAND or size > _MAX_COMMAND_BYTES:
            raise WireFormatError(f"{self.where}: no READY command after the greeting")
        try:
            props = ready_properties(self._recv(size))
        except ValueError:
            raise WireFormatError(f"{self.where}: no READY command after the greeting") from None
        kind = props.get("socket-type", b"").decode("ascii", "replace")
        if kind not in SERVER_TYPES:
            raise WireFormatError(f"{self.where}: the peer is a {kind or '(no type)'} socket, "
                                  "not one a DEALER can ask")

    def _reply(self, max_bytes: int, max_frames: int) -> list[bytes]:
        out: list[bytes] = []
        total = 0
        while True:
            flags, size = self._frame_head()
            if flags & _COMMAND:  # e.g. PING between messages: read, bounded, ignored
                if out or size > _MAX_COMMAND_BYTES:
                    raise WireFormatError(f"{self.where}: unexpected ZMTP command in the reply")
                self._recv(size)
                continue
            if len(out) >= max_frames:
                raise WireFormatError(f"{self.where}: reply of more than the limit of "
                                      f"{max_frames} frames")
            total += size
            if total > max_bytes:  # refused before a byte of the frame is read
                raise WireFormatError(f"{self.where}: reply over the limit of {max_bytes} "
                                      f"bytes{self.limit_name}")
            out.append(self._recv(size))
            if not flags & _MORE:
                return out


def zmtp_request(
    host: str,
    port: int,
    frames: list[bytes],
    *,
    deadline: float,
    max_bytes: int,
    max_frames: int = MAX_FRAMES,
    where: str | None = None,
    limit_name: str = "",
) -> list[bytes]:
    """Send one multipart message as a DEALER to ``host:port`` and return the reply's frames,
    all within ``deadline`` (``time.monotonic()``), on a connection of its own.

    Bounded and failing as ``ZmtpDealer``: more than ``max_frames`` frames or ``max_bytes``
    bytes is a ``WireFormatError`` naming the limit; no answer by the deadline is
    ``HandshakeTimeout``; a refused connection or one closed before the reply is
    ``RetryableHandshakeError`` (the caller retries until its deadline).
    """
    with ZmtpDealer(host, port, deadline=deadline, where=where, limit_name=limit_name) as dealer:
        return dealer.request(frames, max_bytes=max_bytes, max_frames=max_frames)
