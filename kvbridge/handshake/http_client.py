"""The ``http`` side channel's client: HTTP/1.1 on the standard library's ``http.client``,
bounded by one deadline per fetch (``deadline_watchdog``) and by ``max_message_bytes``.

One keep-alive connection per peer (a small pool of idle ones when several threads fetch at
once); TLS contexts and sessions from ``tls_sessions``, shared by every client with the same
settings. Never follows redirects.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import ssl
import threading
import time

from kvbridge.config import TLSConfig
from kvbridge.errors import (
    HandshakeError,
    HandshakeTimeout,
    RetryableHandshakeError,
    WireFormatError,
)
from kvbridge.handshake.authz import TokenSet
from kvbridge.handshake.base import HandshakeClient, Reply
from kvbridge.handshake.deadline_watchdog import WATCHDOG
from kvbridge.handshake.http_routes import MSGPACK, handshake_path
from kvbridge.handshake.tls_sessions import TlsSessions, tls_sessions

__all__ = ["MAX_IDLE_PER_PEER", "HttpHandshakeClient"]

# Idle keep-alive connections kept per peer and client (more only while threads overlap).
MAX_IDLE_PER_PEER = 4


class HttpHandshakeClient(HandshakeClient):
    """Fetches a peer's metadata over HTTP/1.1 (https when a CA or a certificate is set),
    keeping connections alive between fetches; see the module's docstring."""

    method = "http"

    def __init__(self, timeout: float, expected, token: str | None = None,
                 max_message_bytes: int | None = None, tls: TLSConfig | None = None,
                 scheme: str | None = None, token_file: str | None = None):
        """``token_file``: where ``token`` came from; read again when it changes, so the
        token sent follows a rotation without a new client."""
        kwargs = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        super().__init__(timeout, expected, token, **kwargs)
        tls = tls or TLSConfig()
        # https whenever we have a CA to verify the server against (or our own cert).
        self.scheme = scheme or ("https" if (tls.ca_certs or tls.certfile) else "http")
        # Plain http needs no SSL context (building the default one costs ~90 ms).
        self._tls = tls_sessions(tls) if self.scheme == "https" else None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._headers = {"accept": MSGPACK}
        if self.token:
            self._headers["authorization"] = f"Bearer {self.token}"
        self._token_file = None if not (token_file and self.token) else TokenSet(
            {"token": self.token}, path=token_file)

    def _request_headers(self) -> dict[str, str]:
        if self._token_file is None:
            return self._headers
        return {**self._headers, "authorization": f"Bearer {self._token_file.current()}"}

    def idle_sockets(self, host: str, port: int) -> list[socket.socket]:
        """The sockets of the idle keep-alive connections kept for ``host:port``."""
        with self._lock:
            return [c.sock for c in self._idle.get((host, port), [])]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        h = f"[{host}]" if ":" in host else host
        path = handshake_path(tp_rank)
        url = f"{self.scheme}://{h}:{port}{path}"
        if deadline - time.monotonic() <= 0:
            raise HandshakeTimeout(f"http handshake with {url}: no time left")
        # One watchdog over the whole request: at the deadline it shuts the connection
        # under whatever read is blocked (trickled heads and bodies included).
        current: list[_Connection] = []
        watchdog = WATCHDOG.arm(deadline, lambda: current and current[-1].cut())
        try:
            conn = self._take(host, port)
            reused = conn is not None
            while True:
                if conn is None:
                    conn = self._connect(host, port, deadline, current)
                current.append(conn)
                try:
                    status, body, keep = self._exchange(conn, path, url, deadline)
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError,
                        BrokenPipeError):
                    conn.close()
                    if not reused or time.monotonic() >= deadline:
                        raise
                    # The peer closed an idle keep-alive connection: once more, on a new one.
                    conn, reused = None, False
        except (http.client.HTTPException, OSError, ValueError, WireFormatError) as e:
            for c in current:
                c.close()
            if time.monotonic() >= deadline:  # cut by the watchdog: whatever broke, it's late
                raise HandshakeTimeout(f"http handshake with {url}: not complete within "
                                       f"{self.timeout:g}s") from None
            if isinstance(e, WireFormatError):
                raise
            raise self._translate(e, url) from None
        finally:
            watchdog.cancel()
        if time.monotonic() >= deadline:
            conn.close()
            raise HandshakeTimeout(f"{url}: reply not complete within {self.timeout:g}s")
        if keep:
            self._give(host, port, conn)
        else:
            conn.close()
        if status != 200:
            return Reply(status, error=_error_text(body))
        return Reply(200, body)

    def _take(self, host: str, port: int) -> _Connection | None:
        with self._lock:
            conns = self._idle.get((host, port))
            while conns:
                conn = conns.pop()
                if conn.usable():
                    return conn
                conn.close()
        return None

    def _give(self, host: str, port: int, conn: _Connection) -> None:
        with self._lock:
            conns = self._idle.setdefault((host, port), [])
            if len(conns) < MAX_IDLE_PER_PEER:
                conns.append(conn)
                return
        conn.close()

    def _connect(self, host: str, port: int, deadline: float,
                 current: list[_Connection]) -> _Connection:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left to connect")
        try:
            sock = socket.create_connection((host.strip("[]"), port), timeout=left)
        except TimeoutError:
            raise
        except OSError as e:  # refused, unreachable, no such name (yet): the peer may be starting
            raise RetryableHandshakeError(f"{type(e).__name__}: {e}") from None
        conn = _Connection(host, port, sock)
        current.append(conn)  # the watchdog can cut the TLS handshake too
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            conn.wrap(self._tls)
        return conn

    def _exchange(self, conn: _Connection, path: str, url: str,
                  deadline: float) -> tuple[int, bytes, bool]:
        """Send the GET, read the capped reply: (status, body, connection reusable)."""
        conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        conn.http.request("GET", path, headers=self._request_headers())
        resp = conn.http.getresponse()
        body = self._read_capped(resp, url)
        conn.remember_session(self._tls)
        return resp.status, body, not resp.will_close

    def _translate(self, e: Exception, url: str) -> Exception:
        """A transport failure before the deadline, as the error a caller can act on."""
        if isinstance(e, ssl.SSLError | ssl.CertificateError):
            return HandshakeError(f"TLS with {url} failed: {e}")
        if isinstance(e, http.client.RemoteDisconnected | ConnectionResetError
                      | BrokenPipeError):
            hint = ("does it require a client certificate (mTLS)?" if self.scheme == "https"
                    else "is it a TLS server spoken to in plaintext?")
            return HandshakeError(f"{url} closed the connection without an answer ({e}); {hint}")
        if isinstance(e, http.client.HTTPException):  # it answered, but not in HTTP
            return WireFormatError(f"{url} answered something that is not HTTP: "
                                   f"{type(e).__name__}: {e}")
        if isinstance(e, TimeoutError):
            return HandshakeTimeout(f"http handshake with {url}: no answer within "
                                    f"{self.timeout:g}s")
        return HandshakeError(f"http handshake with {url}: {type(e).__name__}: {e}")

    def _read_capped(self, resp: http.client.HTTPResponse, url: str) -> bytes:
        """The body, at most ``max_message_bytes``; a body shorter than declared is an error."""
        limit = self.max_message_bytes
        declared = resp.getheader("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise WireFormatError(f"{url}: reply of {declared} bytes exceeds the limit of {limit}")
        chunks, size = [], 0
        while True:
            chunk = resp.read(min(65536, limit + 1 - size))
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise WireFormatError(f"{url}: reply exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        if resp.length:  # http.client returns short bodies silently when the peer closes
            raise WireFormatError(f"{url}: reply body ended {resp.length} bytes short")
        return b"".join(chunks)


class _Connection:
    """One keep-alive connection: its socket (TLS-wrapped or not) and the http.client
    object that speaks HTTP/1.1 on it."""

    def __init__(self, host: str, port: int, sock: socket.socket):
        self.host, self.port, self.sock = host, port, sock
        self.http = http.client.HTTPConnection(host.strip("[]"), port)
        self.http.sock = sock
        self.resumed = False

    def wrap(self, tls: TlsSessions) -> None:
        session = tls.session(self.host, self.port)
        self.sock = tls.context.wrap_socket(self.sock, server_hostname=self.host.strip("[]"),
                                            session=session)
        self.http.sock = self.sock
        self.resumed = self.sock.session_reused

    def remember_session(self, tls: TlsSessions | None) -> None:
        # TLS 1.3 tickets arrive after the handshake: the session is known once we read.
        if tls is not None and not self.resumed:
            session = getattr(self.sock, "session", None)
            if session is not None:
                tls.remember(self.host, self.port, session)
                self.resumed = True  # one ticket per connection is enough

    def usable(self) -> bool:
        """Still open: an idle connection the peer closed reads as ready (EOF)."""
        try:
            if self.sock.fileno() < 0:
                return False
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def cut(self) -> None:
        """Unblock a read in progress (closing alone does not: the reader sits in recv).
        ``socket.shutdown`` of the base class: SSLSocket's own would drop its TLS state
        under the reading thread."""
        with contextlib.suppress(OSError, ValueError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.http.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def _error_text(body: bytes) -> str:
    text = body[:300].decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)
