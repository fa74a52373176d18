"""Which side channels an instance presents its token to (``trusted_side_channels``).

A decode fetches metadata from whatever side channel a request's ``kv_transfer_params`` or
a ``/v1/kv/prewarm`` call names, and its token goes with the fetch. Whoever can name that
host (a completion sent straight to a decode, a proxy whose token may only prewarm) would
receive the token, and with it every scope it has. So a client with a token fetches only
from side channels matching one of these patterns, and refuses the others before it
connects.

A pattern is ``HOST`` (any port) or ``HOST:PORT``; an IPv6 address in brackets when a port
follows (``[fd00::1]:5600``). In ``HOST``, ``*`` and ``?`` stay within one DNS label
(``prefill-*.kv.internal`` does not match ``prefill-x.attacker.example``); ``*`` alone is
any host. The host is compared as the request names it, before any name resolution: over
TLS the certificate check then ties the name to the server; over plain TCP, whoever
answers at that name gets the token.
"""

from __future__ import annotations

import re

__all__ = ["SideChannelTrust", "label_glob", "parse_trusted"]

_HOST = re.compile(r"[A-Za-z0-9._:*?-]+")  # a name, an address, a pattern of either


def label_glob(pattern: str) -> re.Pattern[str]:
    """``*`` (any run) and ``?`` (one character) within one label: never a ``.`` or
    ``/``. Everything else is literal."""
    parts = {"*": "[^./]*", "?": "[^./]"}
    return re.compile("".join(parts.get(c) or re.escape(c) for c in pattern), re.DOTALL)


def _split(pattern: str) -> tuple[str, int | None]:
    """``HOST`` or ``HOST:PORT`` -> (host, port or None); ``ValueError`` saying why not."""
    if pattern.startswith("["):
        host, sep, rest = pattern[1:].partition("]")
        if not sep or not host:
            raise ValueError(f"{pattern!r}: an IPv6 address needs its closing ']'")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{pattern!r}: expected [ADDRESS]:PORT")
        port = rest[1:] if rest else None
    elif pattern.count(":") == 1:
        host, port = pattern.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address (no port)
        host, port = pattern, None
    if not _HOST.fullmatch(host):
        raise ValueError(f"{pattern!r}: not a host name or address (letters, digits, "
                         "'.', '-', '_', ':' and the wildcards '*' and '?')")
    if port is None:
        return host.lower(), None
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{pattern!r}: the port must be in 1..65535")
    return host.lower(), int(port)


def parse_trusted(text: str) -> str:
    """The setting's check: comma-separated patterns, each well formed (the text
    returned as given, spaces trimmed); ``ValueError`` otherwise."""
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise ValueError("names no side channel")
    for p in patterns:
        _split(p)
    return ",".join(patterns)


class SideChannelTrust:
    """The side channels a client may present its token to."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns
        self._rules = []
        for p in patterns:
            host, port = _split(p)
            self._rules.append((None if host == "*" else label_glob(host), port))

    @classmethod
    def parse(cls, text: str | None) -> SideChannelTrust:
        """The setting's value; None (unset) trusts no side channel."""
        if not text:
            return cls([])
        return cls(parse_trusted(text).split(","))

    def allows(self, host: str, port: int) -> bool:
        name = host.strip("[]").lower()
        return any((glob is None or glob.fullmatch(name)) and want in (None, port)
                   for glob, want in self._rules)
