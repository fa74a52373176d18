"""TLS client contexts and their sessions, shared by every http side-channel client with the
same settings: building a context is costly (~90 ms for the default one), and a TLS session
resumes only within the context that made it, so a new client to a known peer resumes
instead of a full handshake.

Bounded: one context per TLS setting, and when the files of that setting change on disk (a
certificate rotation) the new context replaces the old one, whose sessions go with it; at
most ``MAX_CONTEXTS`` settings and ``MAX_SESSIONS`` peers per context are kept.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections import OrderedDict

from kvbridge.config import TLSConfig

# TLS sessions kept per context (one per peer host:port), oldest dropped first.
MAX_SESSIONS = 1024
# TLS settings with a context kept, least recently used dropped first.
MAX_CONTEXTS = 32


class TlsSessions:
    """An SSL context and the TLS sessions it made, per peer, for resumption."""

    def __init__(self, context: ssl.SSLContext):
        self.context = context
        self.sessions: dict[tuple[str, int], ssl.SSLSession] = {}
        self.lock = threading.Lock()

    def session(self, host: str, port: int) -> ssl.SSLSession | None:
        with self.lock:
            return self.sessions.get((host, port))

    def remember(self, host: str, port: int, session: ssl.SSLSession) -> None:
        with self.lock:
            self.sessions.pop((host, port), None)
            self.sessions[(host, port)] = session
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.pop(next(iter(self.sessions)))


# TLS setting -> (versions of its files on disk, the context made from them)
_CONTEXTS: OrderedDict[TLSConfig, tuple[tuple, TlsSessions]] = OrderedDict()
_LOCK = threading.Lock()


def _file_versions(tls: TLSConfig) -> tuple:
    versions = []
    for f in (tls.certfile, tls.keyfile, tls.ca_certs):
        try:
            st = os.stat(f) if f else None
            versions.append(None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            versions.append(None)  # client_context() says what is wrong with it
    return tuple(versions)


def tls_sessions(tls: TLSConfig) -> TlsSessions:
    """The shared context (and sessions) for ``tls`` as its files are now: a rotated
    certificate, key or CA file gets a new context, and the old one is dropped."""
    versions = _file_versions(tls)
    with _LOCK:
        entry = _CONTEXTS.get(tls)
        if entry is not None and entry[0] == versions:
            _CONTEXTS.move_to_end(tls)
            return entry[1]
    state = TlsSessions(tls.client_context())  # outside the lock: it reads files
    with _LOCK:
        entry = _CONTEXTS.get(tls)
        if entry is not None and entry[0] == versions:  # another thread was first
            return entry[1]
        _CONTEXTS[tls] = (versions, state)
        _CONTEXTS.move_to_end(tls)
        while len(_CONTEXTS) > MAX_CONTEXTS:
            _CONTEXTS.popitem(last=False)
    return state


def cached_contexts() -> int:
    """How many TLS contexts are kept (one per TLS setting in use)."""
    with _LOCK:
        return len(_CONTEXTS)
