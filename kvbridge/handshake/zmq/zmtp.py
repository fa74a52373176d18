"""ZMTP 3.0 (NULL mechanism) spoken by hand, bounded, for the zmq side channels: the framing
both ends share and a listener (``ZmtpListener``); the client is ``dealer``.

libzmq bounds a message's frames one by one (``ZMQ_MAXMSGSIZE``) but not how many frames
a multipart message has, and keeps every frame until the last one arrives: one endless
message of 16 KB frames grows the process by the bytes sent, and that memory is not given
back. Both ends here read frames themselves and stop as soon as a message passes
``max_frames`` frames or ``max_bytes`` bytes, so what a peer can make us hold is bounded.

The listener speaks to DEALER and REQ clients (pyzmq / libzmq) as a ROUTER would: each
request is a multipart message, answered on the same connection in order; a peer that says
it is another socket type is refused. Connections are bounded like the http side channel's
(``kvbridge.guard``): a deadline for the greeting and each message once started, an idle
timeout between messages, and a cap that closes the oldest idle one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable

import uvloop

from kvbridge.guard import ConnectionBudget, ConnectionGuard
from kvbridge.net import grow_fd_table

log = logging.getLogger(__name__)

# A request has a delimiter and a payload; a little room for clients that add frames.
MAX_FRAMES = 8
# The socket types a ROUTER-like listener answers (ZMTP 3.0's valid peers of a ROUTER,
# less ROUTER itself: a side channel is asked, it never asks).
CLIENT_TYPES = frozenset({"REQ", "DEALER"})

_SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
_GREETING = _SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _command(name: bytes, props: dict[bytes, bytes]) -> bytes:
    body = (
        bytes([len(name)])
        + name
        + b"".join(bytes([len(k)]) + k + struct.pack(">I", len(v)) + v for k, v in props.items())
    )
    return _frame(body, _COMMAND)


def _frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


_READY = _command(b"READY", {b"Socket-Type": b"ROUTER"})


class _Dropped(Exception):
    """The peer broke a limit or the protocol: close its connection, answer nothing."""


class _WrongType(Exception):
    """The peer is a ZMTP socket of a type we do not answer: close its connection."""


def ready_properties(body: bytes) -> dict[str, bytes]:
    """The properties of a READY command's body (``\\x05READY`` then name/value pairs);
    names lower-cased, as ZMTP compares them. ``ValueError`` when it is not one."""
    if body[:6] != b"\x05READY":
        raise ValueError("not a READY command")
    props, i = {}, 6
    while i < len(body):
        n = body[i]
        name = body[i + 1:i + 1 + n]
        i += 1 + n
        if len(name) != n or i + 4 > len(body):
            raise ValueError("truncated READY property")
        (size,) = struct.unpack(">I", body[i:i + 4])
        value = body[i + 4:i + 4 + size]
        i += 4 + size
        if len(value) != size:
            raise ValueError("truncated READY property")
        props[name.decode("ascii", "replace").lower()] = value
    return props


# A handler turns a request's frames into the reply's frames (or None: no reply).
Handler = Callable[[list[bytes]], list[bytes] | None]


class ZmtpListener:
    """Serves ``handler`` on an already bound and listening TCP socket, in a thread."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        max_bytes: int,
        max_frames: int = MAX_FRAMES,
        budget: ConnectionBudget | None = None,
        peer_types: frozenset[str] = CLIENT_TYPES,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self.max_bytes = max_bytes
        self.max_frames = max_frames
        self.budget = budget or ConnectionBudget.load(side_channel=True)
        self.guard = ConnectionGuard(self.budget, "zmq side channel")
        self.peer_types = peer_types
        self.dropped = 0  # peers dropped for a message over the limits
        self.wrong_type = 0  # peers refused for their socket type
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        grow_fd_table(self.budget.max_connections)  # as the http side channel: no stall under load
        self._thread = threading.Thread(
            target=uvloop.run, args=(self._serve(),), name="kvbridge-zmq-side-channel", daemon=True
        )
        self._thread.start()
        self._started.wait(10)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` from the listener's loop (``HandshakeServer.when_responsive``)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: no answer
                self._loop.call_soon_threadsafe(fn)

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=64 * 1024)
        self._started.set()
        try:
            await self._stopped.wait()
        finally:
            server.close()
            for conn in list(self._conns):
                conn.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        self.guard.admit(conn)
        self._conns.add(conn)
        try:
            await asyncio.wait_for(self._greet(reader, writer), self.budget.first_byte_timeout)
            while True:
                conn.idle = True
                first = await asyncio.wait_for(
                    reader.readexactly(1), self.budget.keep_alive_timeout
                )
                conn.idle = False
                frames = await asyncio.wait_for(
                    self._message(first[0], reader), self.budget.head_timeout
                )
                if frames is None:
                    continue  # a command (e.g. PING): nothing to answer
                reply = self._handler(frames)
                if reply:
                    writer.write(b"".join(_frame(f, _MORE) for f in reply[:-1]) + _frame(reply[-1]))
                    await writer.drain()
                self.guard.touch(conn)
        except _Dropped as e:
            self.dropped += 1
            self.guard.dropped += 1
            log.warning("zmq side channel: dropped %s: %s", conn.peer, e)
        except _WrongType as e:
            self.wrong_type += 1
            log.warning("zmq side channel: refused %s: %s (connection closed)", conn.peer, e)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._conns.discard(conn)
            self.guard.remove(conn)
            writer.transport.abort()

    async def _greet(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_GREETING)
        peer = await reader.readexactly(64)
        if peer[0] != 0xFF or peer[9] != 0x7F or peer[10] < 3:
            raise _Dropped("not a ZMTP 3 greeting")
        if peer[12:32].rstrip(b"\x00") != b"NULL":
            raise _Dropped("security mechanism other than NULL")
        writer.write(_READY)
        first = await reader.readexactly(1)
        flags, body = await self._frame(first[0], reader, self.max_bytes)
        try:
            if not flags & _COMMAND:
                raise ValueError("not a command")
            props = ready_properties(body)
        except ValueError:
            raise _Dropped("no READY command after the greeting") from None
        kind = props.get("socket-type", b"").decode("ascii", "replace")
        if kind not in self.peer_types:
            raise _WrongType(f"socket type {kind or '(none)'!r}; this side channel answers "
                             f"{' or '.join(sorted(self.peer_types, reverse=True))} sockets only")

    async def _frame(
        self, flags: int, reader: asyncio.StreamReader, room: int
    ) -> tuple[int, bytes]:
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise _Dropped(f"bad frame flags {flags:#x}")
        if flags & _LONG:
            (size,) = struct.unpack(">Q", await reader.readexactly(8))
        else:
            size = (await reader.readexactly(1))[0]
        if size > room:  # refused before a byte of it is read
            raise _Dropped(f"message over {self.max_bytes} bytes")
        return flags, await reader.readexactly(size)

    async def _message(self, flags: int, reader: asyncio.StreamReader) -> list[bytes] | None:
        frames: list[bytes] = []
        room = self.max_bytes
        while True:
            flags, body = await self._frame(flags, reader, room)
            if flags & _COMMAND:
                if frames:
                    raise _Dropped("command inside a message")
                return None
            frames.append(body)
            room -= len(body)
            if not flags & _MORE:
                return frames
            if len(frames) >= self.max_frames:
                raise _Dropped(f"message of more than {self.max_frames} frames")
            flags = (await reader.readexactly(1))[0]


class _Conn:
    """One peer, as the guard sees it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.idle = True  # nothing in flight until a message starts
        self.peer = writer.get_extra_info("peername")

    def _guard_state(self) -> str:
        return "idle" if self.idle else "head"  # a message is answered as soon as read

    def _guard_close(self) -> None:
        self.close()

    def close(self) -> None:
        self.writer.transport.abort()
