"""The proxy's one HTTP client towards engines: TLS settings, URL checks, timeouts, and how
an engine's failure reads to the proxy's client (OpenAI-shaped errors)."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import certifi
import httpx
from starlette.responses import JSONResponse

from kvbridge.errors import AnswerTooLarge, ConfigError
from kvbridge.limits import MAX_ANSWER_BYTES
from kvbridge.openai.responses import error_response
from kvbridge.proxy.transport import AiohttpTransport, read_at_most
from kvbridge.proxy.upstream import CLIENT_KEEP_ALIVE

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "HEALTH_TIMEOUT",
    "EngineClient",
    "Deadline",
    "check_urls",
    "dumps",
    "proxy_error",
    "ssl_context",
    "transport_error",
    "upstream_reason",
]

# Seconds an engine may take: each read and write, a prefill hop's whole answer, a decode's
# first byte. A long prompt's prefill or a long non-streamed generation sends nothing until
# it is done, so this is generous; connecting should be quick.
DEFAULT_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 10.0
HEALTH_TIMEOUT = 5.0  # health probes, releases, shutdown's wait for them


class Deadline:
    """A hop's total deadline, ``seconds`` from now: the engine client's timeouts bound each
    read, and an engine trickling a byte at a time never trips them. ``async with`` it
    around each step of the hop (it can be entered again, the deadline stays); past it,
    ``httpx.ReadTimeout`` saying ``what`` did not come in time, which the failover rules
    read as any timeout. Not across a ``yield`` of an async generator."""

    def __init__(self, seconds: float, what: str) -> None:
        self.when = asyncio.get_running_loop().time() + seconds
        self.what = what
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout_at(self.when)
        await self._timeout.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        timeout, self._timeout = self._timeout, None
        assert timeout is not None
        try:
            return await timeout.__aexit__(*exc)
        except TimeoutError as e:
            raise httpx.ReadTimeout(self.what) from e


def dumps(obj: Any) -> bytes:
    # Our own encoding rather than httpx's json=, which rejects NaN that json.loads accepted.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def ssl_context(
    ca_certs: str | None, client_cert: tuple[str, str] | None
) -> ssl.SSLContext | bool:
    """Verification settings for https engines; files are read now so mistakes fail at start."""
    if ca_certs is None and client_cert is None:
        return True  # httpx's default: verify against certifi's bundle
    try:
        ctx = ssl.create_default_context(cafile=ca_certs or certifi.where())
        if client_cert is not None:
            certfile, keyfile = client_cert
            ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"cannot load TLS files for the proxy's engine client: {exc}") from exc
    return ctx


def check_urls(role: str, urls: Sequence[str], allow_none: bool = False) -> list[str]:
    """``urls`` without trailing slashes; a ``ConfigError`` for one that is not http(s)."""
    if isinstance(urls, str) or not (urls or allow_none):
        raise ConfigError(f"the proxy needs a list of at least one {role} URL (or --registry)")
    out = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"bad {role} URL {url!r}: expected http(s)://host:port")
        out.append(url.rstrip("/"))
    return out


class EngineClient:
    """The ``httpx.AsyncClient`` every hop, probe, prewarm and release goes through.
    ``max_answer_bytes``: the most of an answer it reads whole (``read``, ``read_error``)."""

    def __init__(self, verify: ssl.SSLContext | bool, timeout: httpx.Timeout,
                 max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        self.verify = verify
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes
        self._client: httpx.AsyncClient | None = None
        self._transport: AiohttpTransport | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        # Normally opened by the app's lifespan; opened here too if served without one.
        if self._client is None:
            self.open()
        assert self._client is not None
        return self._client

    def open(self) -> None:
        self._transport = AiohttpTransport(self.verify, CLIENT_KEEP_ALIVE)
        self._client = httpx.AsyncClient(
            # aiohttp's connections (C parser) under httpx's API: kvbridge.proxy.
            # transport. No pool limit (streams can be long-lived: no request queues for a
            # slot); idle connections expire before the engines close them.
            transport=self._transport,
            timeout=self.timeout,
            # Engines are internal: don't route them through HTTP(S)_PROXY from the environment.
            trust_env=False,
        )

    async def read(self, request: httpx.Request) -> httpx.Response:
        """``request`` (built by ``http``) sent on the same connections, its whole answer
        read (at most ``max_answer_bytes``), without httpx's client layer
        (``AiohttpTransport.read``)."""
        self.http  # noqa: B018 - opens the client (and its transport) if needed
        assert self._transport is not None
        return await self._transport.read(request, self.max_answer_bytes)

    async def read_body(self, response: httpx.Response) -> bytes:
        """A streamed answer's body, at most ``max_answer_bytes`` (an httpx error raised
        from ``AnswerTooLarge`` past it; the caller's ``aclose`` then closes the
        connection)."""
        return await read_at_most(response, self.max_answer_bytes)

    def first_byte(self) -> Deadline:
        """A decode's deadline for its answer's head and first chunk (``timeout``)."""
        seconds = self.timeout.read or DEFAULT_TIMEOUT
        return Deadline(seconds, f"no first byte within {seconds:g}s (--timeout)")

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def proxy_error(status: int, message: str, err_type: str = "upstream_error", param: Any = None,
                code: str | None = None) -> JSONResponse:
    """The proxy's error answer: OpenAI's shape, ``code`` the engine's own when it gave one,
    else the HTTP status as a string."""
    return error_response(status, message, err_type, param, code or str(status))


def upstream_reason(resp: httpx.Response) -> tuple[str, str | None, Any, str | None]:
    """(message, type, param, code) of an engine's error reply, whatever shape it has."""
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            etype, code = err.get("type"), err.get("code")
            return (str(err["message"]), etype if isinstance(etype, str) else None,
                    err.get("param"), code if isinstance(code, str) else None)
        for key in ("message", "detail", "error"):
            if isinstance(data.get(key), str):
                return data[key], None, None, None
    text = resp.text.strip()[:1000]
    return text or resp.reason_phrase or "no reason given", None, None, None


def transport_error(role: str, url: str, exc: httpx.HTTPError) -> JSONResponse:
    """502/504 for an engine that could not be reached, did not answer in time, or
    answered more than the proxy reads."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc.__cause__, AnswerTooLarge):
        return proxy_error(502, f"{role} {url}: {detail}")
    if isinstance(exc, httpx.TimeoutException):
        return proxy_error(504, f"{role} {url} timed out ({type(exc).__name__}): {detail}",
                           "timeout")
    return proxy_error(502, f"{role} {url} unreachable ({type(exc).__name__}): {detail}")
