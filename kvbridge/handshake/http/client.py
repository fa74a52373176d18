"""The ``http`` side channel's client: HTTP/1.1 on a socket, the request written whole and
the reply read by ``reply`` (llhttp), bounded by one deadline per fetch
(``deadlines``) and by ``max_message_bytes``.

One keep-alive connection per peer (a small pool of idle ones when several threads fetch at
once); TLS contexts and sessions from ``tls_sessions``, shared by every client with the same
settings: a new connection to a peer met before resumes its TLS session. Never follows
redirects.

Keep-warm (``keep_warm``, off unless asked for): the peer closes an idle keep-alive connection
after its keep-alive timeout, and the next fetch then pays a TCP connect and a (resumed) TLS
handshake. A client with ``keep_warm=S`` keeps the connection to every peer it fetched from
(at most ``MAX_WARM_PEERS``): every ``S / 2`` seconds a background thread sends ``GET
/healthz`` (no token, no metadata) on each connection idle for ``S / 2`` or more (so none
stays idle much past ``S``), or reconnects (resuming the TLS session) when the peer closed
it. A peer that does not answer
is forgotten until the next fetch. ``warm(host, port)`` does the same once, on demand.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import select
import socket
import ssl
import threading
import time
from collections import OrderedDict

from kvbridge.config import TLSConfig
from kvbridge.errors import (
    HandshakeError,
    HandshakeTimeout,
    RetryableHandshakeError,
    WireFormatError,
)
from kvbridge.handshake.authz import TokenSet
from kvbridge.handshake.base import HandshakeClient, Reply
from kvbridge.handshake.http.deadlines import WATCHDOG
from kvbridge.handshake.http.reply import ClosedBeforeAnswer, read_reply
from kvbridge.handshake.http.routes import MSGPACK, handshake_path
from kvbridge.handshake.http.tls_sessions import TlsSessions, tls_sessions
from kvbridge.net import url_host

__all__ = ["MAX_IDLE_PER_PEER", "MAX_WARM_PEERS", "HttpHandshakeClient"]

# Idle keep-alive connections kept per peer and client (more only while threads overlap).
MAX_IDLE_PER_PEER = 4
# Peers a keep-warm client keeps a connection to, the least recently used dropped first.
MAX_WARM_PEERS = 256
# What a keep-warm request asks for: the liveness route (no token, no metadata read).
KEEP_WARM_PATH = "/healthz"
# The longest a fetch waits for the connection a keep-warm request is using (it answers in
# well under a millisecond) before it opens a new one: a fetch should not pay a connect
# because a ping happened to hold the only warm connection.
WARM_WAIT_S = 0.5
# A connection that answered this recently is taken as open without a look (see fresh).
FRESH_S = 1.0

# What a header value may hold: visible Latin-1, spaces and tabs (no CR, LF or NUL).
_HEADER_SAFE = re.compile(r"[\t\x20-\x7e\xa0-\xff]*")

log = logging.getLogger(__name__)


class HttpHandshakeClient(HandshakeClient):
    """Fetches a peer's metadata over HTTP/1.1 (https when a CA or a certificate is set),
    keeping connections alive between fetches; see the module's docstring."""

    method = "http"

    def __init__(self, timeout: float, expected, token: str | None = None,
                 max_message_bytes: int | None = None, tls: TLSConfig | None = None,
                 scheme: str | None = None, token_file: str | None = None,
                 keep_warm: float | None = None):
        """``token_file``: where ``token`` came from; read again when it changes, so the
        token sent follows a rotation without a new client. ``keep_warm``: the longest a
        connection to a known peer stays idle before a keep-warm request (below the peer's
        keep-alive timeout; None: no keep-warm thread)."""
        if keep_warm is not None and not keep_warm > 0:
            raise ValueError(f"keep_warm must be > 0 seconds, got {keep_warm!r}")
        kwargs = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        super().__init__(timeout, expected, token, **kwargs)
        tls = tls or TLSConfig()
        # https whenever we have a CA to verify the server against (or our own cert).
        self.scheme = scheme or ("https" if (tls.ca_certs or tls.certfile) else "http")
        # Plain http needs no SSL context (building the default one costs ~90 ms).
        self._tls = tls_sessions(tls) if self.scheme == "https" else None
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)  # a connection went back idle
        self._warming: set[tuple[str, int]] = set()  # peers with a keep-warm request out
        self._requests: dict[tuple[str, int, str, str | None], bytes] = {}
        self._token_file = None if not (token_file and self.token) else TokenSet(
            {"token": self.token}, path=token_file)
        self.keep_warm = keep_warm
        # peer -> monotonic time of its last answer (fetch or keep-warm), least recent first
        self._known: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._stop = threading.Event()
        self._warmer: threading.Thread | None = None

    def _request_bytes(self, host: str, port: int, path: str) -> bytes:
        """The whole GET, kept per peer, path and token (the token file may rotate). A
        keep-warm request carries no token: the liveness route needs none, and a peer
        warmed on demand has not been checked against ``trusted``."""
        token = None if path == KEEP_WARM_PATH else (
            self.token if self._token_file is None else self._token_file.current())
        key = (host, port, path, token)
        request = self._requests.get(key)
        if request is None:
            head = (f"GET {path} HTTP/1.1\r\nHost: {url_host(host)}:{port}\r\n"
                    f"Accept: {MSGPACK}\r\n")
            if token:
                if not _HEADER_SAFE.fullmatch(token):  # no header injection, as http.client
                    raise ValueError("the token has a character an HTTP header cannot carry")
                head += f"Authorization: Bearer {token}\r\n"
            request = (head + "\r\n").encode("latin-1")
            if len(self._requests) >= MAX_WARM_PEERS:
                self._requests.clear()
            self._requests[key] = request
        return request

    def idle_sockets(self, host: str, port: int) -> list[socket.socket]:
        """The sockets of the idle keep-alive connections kept for ``host:port``."""
        with self._lock:
            return [c.sock for c in self._idle.get((host, port), [])]

    def known_peers(self) -> list[tuple[str, int]]:
        """The peers a keep-warm client keeps a connection to, least recently used first."""
        with self._lock:
            return list(self._known)

    def warm(self, host: str, port: int) -> bool:
        """Keep a verified connection to ``host:port`` ready for the next fetch: ``GET
        /healthz`` on the idle keep-alive connection, or on a new one (resuming the peer's
        TLS session when there is one). Bounded by the client's timeout, like a fetch.
        True when the peer answered; False (never an exception) otherwise."""
        with self._lock:
            self._warming.add((host, port))
        try:
            reply = self._request(host, port, None, time.monotonic() + self.timeout,
                                  path=KEEP_WARM_PATH)
        except Exception as e:  # a keep-warm failure only means the next fetch connects
            log.debug("keep-warm %s:%s: %s", host, port, e)
            with self._lock:
                self._known.pop((host, port), None)
            return False
        finally:
            with self._lock:
                self._warming.discard((host, port))
                self._returned.notify_all()
        return reply.status == 200

    def close(self) -> None:
        self._stop.set()
        warmer = self._warmer
        if warmer is not None and warmer is not threading.current_thread():
            warmer.join()  # a keep-warm request in flight is bounded by the timeout
        with self._lock:
            idle, self._idle = self._idle, {}
            self._known.clear()
        for conns in idle.values():
            for c in conns:
                c.close()

    def _seen(self, host: str, port: int) -> None:
        """``host:port`` answered: keep its connection warm (when keep-warm is on)."""
        if self.keep_warm is None or self._stop.is_set():
            return
        with self._lock:
            self._known[(host, port)] = time.monotonic()
            self._known.move_to_end((host, port))
            while len(self._known) > MAX_WARM_PEERS:
                self._known.popitem(last=False)
            if self._warmer is None:
                self._warmer = threading.Thread(target=self._keep_warm, daemon=True,
                                                name="kvbridge-keep-warm")
                self._warmer.start()

    def _keep_warm(self) -> None:
        assert self.keep_warm is not None
        while not self._stop.wait(self.keep_warm / 2):
            now = time.monotonic()
            with self._lock:
                due = [peer for peer, seen in self._known.items()
                       if now - seen >= self.keep_warm / 2]
            for host, port in due:
                if self._stop.is_set():
                    return
                self.warm(host, port)

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float,
                 path: str | None = None) -> Reply:
        path = path or handshake_path(tp_rank)
        url = f"{self.scheme}://{url_host(host)}:{port}{path}"
        if deadline - time.monotonic() <= 0:
            raise HandshakeTimeout(f"http handshake with {url}: no time left")
        # One watchdog over the whole request: at the deadline it shuts the connection
        # under whatever read is blocked (trickled heads and bodies included).
        current: list[_Connection] = []
        watchdog = WATCHDOG.arm(deadline, lambda: current and current[-1].cut())
        try:
            conn = self._take(host, port, wait_until=None if path == KEEP_WARM_PATH
                              else min(deadline, time.monotonic() + WARM_WAIT_S))
            reused = conn is not None
            while True:
                if conn is None:
                    conn = self._connect(host, port, deadline, current)
                current.append(conn)
                try:
                    status, body, keep = self._exchange(conn, path, url, deadline)
                    break
                except (ClosedBeforeAnswer, ConnectionResetError, BrokenPipeError,
                        ssl.SSLEOFError, ssl.SSLZeroReturnError):
                    conn.close()
                    if not reused or time.monotonic() >= deadline:
                        raise
                    # The peer closed an idle keep-alive connection (over TLS, maybe without
                    # a close_notify): once more, on a new one.
                    conn, reused = None, False
        except (OSError, ValueError, WireFormatError) as e:
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
            self._seen(host, port)
        else:
            conn.close()
        if status != 200:
            return Reply(status, error=_error_text(body))
        return Reply(200, body)

    def _take(self, host: str, port: int, wait_until: float | None) -> _Connection | None:
        """An idle connection to the peer, or None. With ``wait_until``, while the peer's
        only connection is out on a keep-warm request, wait (until then) for it to return."""
        with self._lock:
            while True:
                conns = self._idle.get((host, port))
                while conns:
                    conn = conns.pop()
                    if conn.fresh() or conn.usable():
                        return conn
                    conn.close()
                left = None if wait_until is None else wait_until - time.monotonic()
                if left is None or left <= 0 or (host, port) not in self._warming:
                    return None
                self._returned.wait(left)

    def _give(self, host: str, port: int, conn: _Connection) -> None:
        with self._lock:
            conns = self._idle.setdefault((host, port), [])
            if len(conns) < MAX_IDLE_PER_PEER:
                conns.append(conn)
                self._returned.notify_all()
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
            if self._tls.session(host, port) is None:  # one an idle connection holds
                with self._lock:
                    for idle in self._idle.get((host, port), []):
                        idle.remember_session()
            conn.wrap(self._tls)
        # Set once, not per request (each settimeout is a syscall): a bound on every
        # socket operation as a second line; the fetch's deadline is the watchdog's.
        conn.sock.settimeout(self.timeout)
        return conn

    def _exchange(self, conn: _Connection, path: str, url: str,
                  deadline: float) -> tuple[int, bytes, bool]:
        """Send the GET, read the capped reply: (status, body, connection reusable)."""
        conn.sock.sendall(self._request_bytes(conn.host, conn.port, path))
        reply = read_reply(conn.sock, self.max_message_bytes, url)
        conn.answered = True
        conn.used = time.monotonic()
        return reply

    def _translate(self, e: Exception, url: str) -> Exception:
        """A transport failure before the deadline, as the error a caller can act on."""
        if isinstance(e, ssl.SSLError | ssl.CertificateError):
            return HandshakeError(f"TLS with {url} failed: {e}")
        if isinstance(e, ClosedBeforeAnswer | ConnectionResetError | BrokenPipeError):
            hint = ("does it require a client certificate (mTLS)?" if self.scheme == "https"
                    else "is it a TLS server spoken to in plaintext?")
            return HandshakeError(f"{url} closed the connection without an answer ({e}); {hint}")
        if isinstance(e, TimeoutError):
            return HandshakeTimeout(f"http handshake with {url}: no answer within "
                                    f"{self.timeout:g}s")
        return HandshakeError(f"http handshake with {url}: {type(e).__name__}: {e}")


class _Connection:
    """One keep-alive connection: its socket, TLS-wrapped or not."""

    def __init__(self, host: str, port: int, sock: socket.socket):
        self.host, self.port, self.sock = host, port, sock
        self.resumed = False
        self.answered = False  # a reply was read (a TLS 1.3 ticket arrives with it)
        self.used = 0.0  # time.monotonic() of its last reply
        self._tls: TlsSessions | None = None

    def wrap(self, tls: TlsSessions) -> None:
        session = tls.session(self.host, self.port)
        self.sock = tls.context.wrap_socket(self.sock, server_hostname=self.host.strip("[]"),
                                            session=session)
        self._tls = tls
        self.resumed = self.sock.session_reused

    def remember_session(self) -> None:
        """Keep this connection's TLS session for the next connection to the peer. Not
        done on a fetch's path: Python copies a session through its DER form, certificates
        and all (~0.2 ms), so it is taken when the connection closes, or when another
        connection to the peer is about to be made while this one is idle."""
        if self._tls is not None and self.answered and not self.resumed:
            session = getattr(self.sock, "session", None)
            if session is not None:
                self._tls.remember(self.host, self.port, session)
                self.resumed = True  # one ticket per connection is enough

    def fresh(self) -> bool:
        """Answered within ``FRESH_S``: no peer closes a connection idle for so little (the
        select of ``usable`` is skipped). A peer that closed it anyway (a restart) costs
        the fetch one retry on a new connection, as a close racing the request does."""
        return time.monotonic() - self.used < FRESH_S

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
        with contextlib.suppress(OSError, ValueError):
            self.remember_session()
        with contextlib.suppress(OSError):
            self.sock.close()


def _error_text(body: bytes) -> str:
    text = body[:300].decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)
