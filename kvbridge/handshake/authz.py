"""Who may fetch metadata (or release a hold), decided per peer, and a record of who did.

* **Named tokens.** ``tokens_file`` holds one ``name:token`` per line (``#`` comments),
  or ``name[scope,...]:token`` to limit what the token may do: ``metadata`` (fetch from
  the side channel), ``release`` (a prefill's ``/v1/kv/release``), ``prewarm`` (a
  decode's ``/v1/kv/prewarm``); a line without scopes has them all. Each peer (or group
  of peers) gets its own token, and removing its line revokes it. Without it, the single
  ``token`` (or ``token_file``) is accepted under the name ``token``, for everything.
  Both files are read again whenever they change on disk (checked on each request: one
  ``stat``; a ``chmod`` is a change), so a token is rotated without a restart: add the
  new one, move the peers to it, remove the old one. A server fails closed: while its
  file cannot be trusted (gone, unreadable, readable by group or others, a line that is
  not a token, a name twice) it accepts no token at all, and says so once per change.
* **Certificate allow-list.** With mutual TLS, ``ssl_allowed_peers`` (comma-separated
  glob patterns; ``*`` and ``?`` never cross a ``.`` or ``/``, so ``*`` stands for
  within one DNS label) admits only client certificates whose subject CN or one of whose
  subjectAltNames (DNS, URI, IP; other kinds are ignored) matches a pattern; a valid
  certificate from the right CA that is not on the list, or no certificate, gets 403.
* **Audit log** (``kvbridge.handshake.audit``): one JSON line per metadata fetch, refusal
  and release, refusals rate-limited.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.handshake.audit import AuditLog
from kvbridge.tokens import (
    TOKEN_SCOPES,
    NamedToken,
    parse_tokens,
    read_named_tokens,
    read_token_file,
)
from kvbridge.trust import label_glob

__all__ = ["TOKEN_SCOPES", "AuditLog", "Authorizer", "Decision", "NamedToken", "PeerAllowList",
           "TokenSet", "cert_identities", "parse_tokens", "read_named_tokens"]

log = logging.getLogger(__name__)

_Stamp = tuple[int, ...] | str  # a file's identity and state, or why it cannot be stat'ed


class TokenSet:
    """The tokens a server accepts, by name; files are read again when they change.

    ``fail_closed`` (a server): a file that cannot be trusted empties the set until it is
    fixed. Otherwise (a client's own token) the last good token is kept."""

    def __init__(self, tokens: Mapping[str, str | NamedToken] | None, *,
                 path: str | None = None, named: bool = False, fail_closed: bool = False):
        self._tokens = None if tokens is None else {
            k: v if isinstance(v, NamedToken) else NamedToken(v) for k, v in tokens.items()}
        self._path = path
        self._named = named
        self._fail_closed = fail_closed
        self._stamp = self._stat()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: SideChannelConfig) -> TokenSet:
        if cfg.tokens_file:
            return cls(read_named_tokens(cfg.tokens_file), path=cfg.tokens_file, named=True,
                       fail_closed=True)
        if cfg.token is None:
            return cls(None)
        return cls({"token": cfg.token}, path=cfg.token_file, fail_closed=True)

    @property
    def required(self) -> bool:
        return self._tokens is not None

    def _stat(self) -> _Stamp | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError as e:
            return e.strerror or type(e).__name__
        # ctime and mode too: a chmod alone changes whether the file can be trusted
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode)

    def _read(self, stamp: _Stamp) -> dict[str, NamedToken]:
        path = self._path
        assert path is not None
        if isinstance(stamp, str):
            raise ConfigError(f"cannot read {path}: {stamp}")
        if self._named:
            return read_named_tokens(path)
        return {"token": NamedToken(read_token_file(path))}

    def _refresh(self) -> None:
        if self._path is None:
            return
        stamp = self._stat()
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp  # whatever comes of it, said once for this state of the file
            try:
                tokens = self._read(stamp)  # type: ignore[arg-type]
            except ConfigError as e:
                if self._fail_closed:
                    self._tokens = {}
                    log.error("refusing every token until %s is fixed: %s", self._path, e)
                else:
                    log.warning("keeping the last good token: %s", e)
                return
            self._tokens = tokens
            log.info("tokens re-read from %s (%d)", self._path, len(tokens))

    def current(self, name: str = "token") -> str | None:
        """The token called ``name`` now (a client's own token, after a rotation)."""
        self._refresh()
        found = None if self._tokens is None else self._tokens.get(name)
        return None if found is None else found.token

    def find(self, given: str | None) -> tuple[str, frozenset[str]] | None:
        """The name and scopes of the token ``given`` is, or None. Every token is
        compared, in constant time each."""
        self._refresh()
        tokens = self._tokens
        if tokens is None or given is None:
            return None
        found = None
        raw = given.encode("utf-8", "surrogateescape")
        for name, named in tokens.items():
            if hmac.compare_digest(named.token.encode("utf-8", "surrogateescape"), raw):
                found = (name, named.scopes)
        return found

    def match(self, given: str | None) -> str | None:
        """The name of the token ``given`` is, or None."""
        found = self.find(given)
        return None if found is None else found[0]


_SAN_KINDS = frozenset({"DNS", "URI", "IP Address"})  # what a pattern can name


def _pairs(items: Any) -> list[tuple[Any, Any]]:
    """The (key, value) pairs of a tuple of pairs; anything else is skipped."""
    if not isinstance(items, (tuple, list)):
        return []
    return [(i[0], i[1]) for i in items if isinstance(i, (tuple, list)) and len(i) == 2]


def cert_identities(cert: Any) -> list[str]:
    """Subject CN and the DNS, URI and IP subjectAltName values of a peer certificate
    (``getpeercert()``). Other SAN kinds (a DirName, an email, a registered id) name no
    host: they are skipped, whatever their shape."""
    if not cert or not isinstance(cert, dict):
        return []
    subject = cert.get("subject")
    rdns = subject if isinstance(subject, (tuple, list)) else ()
    out = [value for rdn in rdns for key, value in _pairs(rdn)
           if key == "commonName" and isinstance(value, str)]
    out += [value for kind, value in _pairs(cert.get("subjectAltName"))
            if kind in _SAN_KINDS and isinstance(value, str)]
    return out


class PeerAllowList:
    """Glob patterns a client certificate's CN or a SAN must match."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns
        self._compiled = [label_glob(p) for p in patterns]

    @classmethod
    def parse(cls, text: str | None) -> PeerAllowList | None:
        if not text:
            return None
        patterns = [p.strip() for p in text.split(",") if p.strip()]
        if not patterns:
            raise ConfigError("ssl_allowed_peers names no pattern")
        return cls(patterns)

    def allows(self, identities: list[str]) -> bool:
        return any(p.fullmatch(i) for i in identities for p in self._compiled)


@dataclass(frozen=True)
class Decision:
    status: int  # 200: allowed; 401: token; 403: certificate not allowed, or token's scope
    token: str | None  # the token's name
    cert: str | None  # the certificate's identity (its CN, else its first SAN)
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


class Authorizer:
    """Tokens + certificate allow-list + audit log of one server."""

    def __init__(self, tokens: TokenSet, allowed: PeerAllowList | None = None,
                 audit: AuditLog | None = None):
        self.tokens = tokens
        self.allowed = allowed
        self.audit = audit

    @classmethod
    def from_config(cls, cfg: SideChannelConfig) -> Authorizer:
        return cls(TokenSet.from_config(cfg), PeerAllowList.parse(cfg.ssl_allowed_peers),
                   AuditLog(cfg.audit_log) if cfg.audit_log else None)

    @classmethod
    def token_only(cls, token: str | None) -> Authorizer:
        return cls(TokenSet(None if token is None else {"token": token}))

    def decide(self, authorization: str | None, peer_cert: dict[str, Any] | None,
               scope: str = "metadata") -> Decision:
        """May this caller (its ``authorization`` header, the client certificate its
        connection verified) do ``scope`` (one of ``TOKEN_SCOPES``)?"""
        ids = cert_identities(peer_cert)
        cert = ids[0] if ids else None
        if self.allowed is not None and not self.allowed.allows(ids):
            return Decision(403, None, cert, "client certificate not allowed: " + (
                "this connection presented none (ssl_allowed_peers needs mutual TLS)"
                if not peer_cert else f"{cert[:128]!r} matches no ssl_allowed_peers pattern"
                if cert else "its certificate names no host (CN, DNS, URI or IP)"))
        scheme, _, given = (authorization or "").partition(" ")
        name = None
        if self.tokens.required:
            found = self.tokens.find(given if scheme.lower() == "bearer" else None)
            if found is None:
                # Same answer for a missing and a wrong token: nothing to probe.
                return Decision(401, None, cert, "missing or invalid bearer token")
            name, scopes = found
            if scope not in scopes:
                return Decision(403, name, cert, f"token {name!r} does not have the "
                                                 f"{scope!r} scope")
        return Decision(200, name, cert)

    def record(self, decision: Decision, peer: str | None, route: str, rank: int | None,
               result: str | None = None) -> None:
        if self.audit is not None:
            self.audit.write(peer=peer, cert=decision.cert, token=decision.token, route=route,
                             rank=rank, result=result or ("ok" if decision.ok else
                                                          f"refused {decision.status}"))

    def close(self) -> None:
        """Write what the audit log still counts, and close it."""
        if self.audit is not None:
            self.audit.close()
