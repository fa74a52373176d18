"""A raw ZMTP 3.0 peer over a plain socket, to send what no libzmq client would."""

from __future__ import annotations

import socket
import struct

GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def ready(socket_type: bytes) -> bytes:
    """The READY command of a ``socket_type`` socket."""
    return frame(b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type,
                 command=True)


READY = ready(b"DEALER")


def connect(host: str, port: int, timeout: float = 30.0,
            socket_type: bytes = b"DEALER") -> socket.socket:
    """A connection past the greeting and READY, ready for message frames."""
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(GREETING + ready(socket_type))
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def accept_as_router(conn: socket.socket) -> None:
    """The server side of the handshake, as a ROUTER: greeting and READY exchanged, and the
    client's request read (up to what arrived with its READY)."""
    conn.sendall(GREETING + ready(b"ROUTER"))
    recv_exactly(conn, 64)
    conn.recv(65536)


def send_until_closed(s: socket.socket, frame_bytes: int, max_frames: int) -> int:
    """One message of up to ``max_frames`` frames, never ended; the frames sent before
    the peer closed the connection (``max_frames`` if it never did)."""
    chunk = frame(b"\x00" * frame_bytes, more=True)
    for i in range(max_frames):
        try:
            s.sendall(chunk)
        except OSError:  # reset or broken pipe: the server dropped us
            return i
    return max_frames


def streaming_router(frame_bytes: bytes, sent: list[int], max_frames: int = 100_000):
    """A ZMTP ROUTER (a ``tests.helpers.RawServer``) that answers any request with
    ``frame_bytes`` over and over, never ending the message; ``sent`` gets how many frames
    went out before the client let go."""
    from tests.helpers import RawServer

    def handler(conn: socket.socket) -> None:
        accept_as_router(conn)
        conn.settimeout(30)
        n = 0
        try:
            while n < max_frames:
                conn.sendall(frame_bytes)
                n += 1
        except OSError:
            pass
        finally:
            sent.append(n)

    return RawServer(handler)
