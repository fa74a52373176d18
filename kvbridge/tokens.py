"""Token files: the side channel's token (``token_file``, re-read when it changes) and
named tokens with scopes (``tokens_file``). A secret file that group or others may read is
refused."""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import ConfigError

__all__ = ["TOKEN_SCOPES", "NamedToken", "parse_tokens", "read_named_tokens", "read_token_file"]


def _read_secret(path: str, what: str) -> str:
    """The text of a secret file, refused when group or others may read it (or it is not
    UTF-8: a ``ConfigError`` either way, never another exception)."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what} {path} is readable by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None


def read_token_file(path: str) -> str:
    text = _read_secret(path, "token file").strip()
    if not text:
        raise ConfigError(f"token file {path} is empty")
    return text


# What a named token may be used for. A ``tokens_file`` line without scopes has them all.
TOKEN_SCOPES: tuple[str, ...] = ("metadata", "release", "prewarm")
_TOKEN_NAME = re.compile(r"([A-Za-z0-9_.@-]{1,64})(?:\[([a-z,]*)\])?")


@dataclass(frozen=True)
class NamedToken:
    """One ``tokens_file`` line: the token and what it may do (``TOKEN_SCOPES``)."""

    token: str
    scopes: frozenset[str] = frozenset(TOKEN_SCOPES)


def _scopes(text: str | None, where: str) -> frozenset[str]:
    if text is None:
        return frozenset(TOKEN_SCOPES)
    scopes = text.split(",")
    unknown = [s for s in scopes if s not in TOKEN_SCOPES]
    if unknown or len(set(scopes)) != len(scopes):
        raise ConfigError(f"{where}: scopes must be distinct ones of {', '.join(TOKEN_SCOPES)}"
                          f" (got {text[:64]!r})")
    return frozenset(scopes)


def parse_tokens(text: str, path: str) -> dict[str, NamedToken]:
    """``NAME:TOKEN`` or ``NAME[SCOPE,...]:TOKEN`` lines (blank lines and ``#`` comments
    skipped) -> {name: NamedToken}. Any line that is not one of these refuses the whole
    file: a server then accepts no named token (it fails closed)."""
    out: dict[str, NamedToken] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, sep, token = line.partition(":")
        head, token = head.strip(), token.strip()
        m = _TOKEN_NAME.fullmatch(head)
        if not sep or m is None or not token:
            raise ConfigError(f"{path}:{n}: expected NAME:TOKEN or NAME[SCOPE,...]:TOKEN "
                              "(NAME of [A-Za-z0-9_.@-])")
        name = m.group(1)
        if name in out:
            raise ConfigError(f"{path}:{n}: token name {name!r} appears twice")
        out[name] = NamedToken(token, _scopes(m.group(2), f"{path}:{n}"))
    if not out:
        raise ConfigError(f"{path}: no NAME:TOKEN line")
    return out


def read_named_tokens(path: str) -> dict[str, NamedToken]:
    """A ``tokens_file``: ``name -> NamedToken``. The side channel's ``authz`` re-reads it
    when it changes; here so that a bad file fails when the settings are checked."""
    return parse_tokens(_read_secret(path, "tokens file"), path)
