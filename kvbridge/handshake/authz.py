"""Who may fetch metadata (or release a hold), decided per peer, and a record of who did.

* **Named tokens.** ``tokens_file`` holds one ``name:token`` per line (``#`` comments):
  each peer (or group of peers) gets its own token, and removing its line revokes it.
  Without it, the single ``token`` (or ``token_file``) is accepted under the name
  ``token``. Both files are read again whenever they change on disk (checked on each
  request: one ``stat``), so a token is rotated without a restart: add the new one, move
  the peers to it, remove the old one. A file that became unreadable or empty keeps the
  last good set (logged once).
* **Certificate allow-list.** With mutual TLS, ``ssl_allowed_peers`` (comma-separated
  glob patterns) admits only client certificates whose subject CN or one of whose
  subjectAltNames (DNS, URI, IP) matches a pattern; a valid certificate from the right
  CA that is not on the list gets 403.
* **Audit log.** ``audit_log`` (a path) gets one JSON line per metadata fetch, refusal
  and release: ``time``, ``peer`` (address), ``cert`` (certificate identity), ``token``
  (token name), ``route``, ``rank``, ``result``.
"""

from __future__ import annotations

import fnmatch
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvbridge.config import SideChannelConfig, parse_tokens, read_named_tokens, read_token_file
from kvbridge.errors import ConfigError

__all__ = ["AuditLog", "Authorizer", "Decision", "PeerAllowList", "TokenSet",
           "cert_identities", "parse_tokens", "read_named_tokens"]

log = logging.getLogger(__name__)

class TokenSet:
    """The tokens a server accepts, by name; files are read again when they change."""

    def __init__(self, tokens: dict[str, str] | None, *, path: str | None = None,
                 named: bool = False):
        self._tokens = tokens  # None: no token required
        self._path = path
        self._named = named
        self._stamp = self._stat()
        self._lock = threading.Lock()
        self._warned = False

    @classmethod
    def from_config(cls, cfg: SideChannelConfig) -> TokenSet:
        if cfg.tokens_file:
            return cls(read_named_tokens(cfg.tokens_file), path=cfg.tokens_file, named=True)
        if cfg.token is None:
            return cls(None)
        return cls({"token": cfg.token}, path=cfg.token_file)

    @property
    def required(self) -> bool:
        return self._tokens is not None

    def _stat(self) -> tuple[int, int, int] | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _refresh(self) -> None:
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                tokens = (read_named_tokens(self._path) if self._named
                          else {"token": read_token_file(self._path)})  # type: ignore[arg-type]
            except ConfigError as e:
                if not self._warned:
                    log.warning("keeping the last good tokens: %s", e)
                    self._warned = True
                return
            self._tokens, self._stamp, self._warned = tokens, stamp, False
            log.info("tokens re-read from %s (%d)", self._path, len(tokens))

    def current(self, name: str = "token") -> str | None:
        """The token called ``name`` now (a client's own token, after a rotation)."""
        self._refresh()
        return None if self._tokens is None else self._tokens.get(name)

    def match(self, given: str | None) -> str | None:
        """The name of the token ``given`` is, or None. Every token is compared, in
        constant time each."""
        self._refresh()
        tokens = self._tokens
        if tokens is None or given is None:
            return None
        found = None
        for name, token in tokens.items():
            if hmac.compare_digest(token.encode(), given.encode()):
                found = name
        return found


def cert_identities(cert: dict[str, Any] | None) -> list[str]:
    """Subject CN and subjectAltName values of a peer certificate (``getpeercert()``)."""
    if not cert:
        return []
    out = [value for rdn in cert.get("subject", ()) for key, value in rdn
           if key == "commonName"]
    out += [value for _, value in cert.get("subjectAltName", ())]
    return out


class PeerAllowList:
    """Glob patterns a client certificate's CN or a SAN must match."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns

    @classmethod
    def parse(cls, text: str | None) -> PeerAllowList | None:
        if not text:
            return None
        patterns = [p.strip() for p in text.split(",") if p.strip()]
        if not patterns:
            raise ConfigError("ssl_allowed_peers names no pattern")
        return cls(patterns)

    def allows(self, identities: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(i, p) for i in identities for p in self.patterns)


class AuditLog:
    """JSON lines appended to ``path``, one per decision (thread-safe)."""

    def __init__(self, path: str):
        try:
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as us
        except OSError as e:
            raise ConfigError(f"cannot open the audit log {path}: {e.strerror}") from None
        self._lock = threading.Lock()
        self.lines = 0

    def write(self, **fields: Any) -> None:
        line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
                           + f".{int(time.time() * 1000) % 1000:03d}Z", **fields},
                          separators=(",", ":"), default=str)
        with self._lock:
            self._file.write(line + "\n")
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass(frozen=True)
class Decision:
    status: int  # 200: allowed; 401: token; 403: certificate not on the allow-list
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

    def decide(self, authorization: str | None, peer_cert: dict[str, Any] | None
               ) -> Decision:
        ids = cert_identities(peer_cert)
        cert = ids[0] if ids else None
        if self.allowed is not None and not self.allowed.allows(ids):
            return Decision(403, None, cert, "client certificate not allowed")
        scheme, _, given = (authorization or "").partition(" ")
        name = None
        if self.tokens.required:
            name = self.tokens.match(given if scheme.lower() == "bearer" else None)
            if name is None:
                # Same answer for a missing and a wrong token: nothing to probe.
                return Decision(401, None, cert, "missing or invalid bearer token")
        return Decision(200, name, cert)

    def record(self, decision: Decision, peer: str | None, route: str, rank: int | None,
               result: str | None = None) -> None:
        if self.audit is not None:
            self.audit.write(peer=peer, cert=decision.cert, token=decision.token, route=route,
                             rank=rank, result=result or ("ok" if decision.ok else
                                                          f"refused {decision.status}"))
