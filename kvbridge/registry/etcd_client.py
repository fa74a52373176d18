"""etcd v3 through its gRPC gateway (JSON over HTTP/1.1): unary calls (lease, put, range)
with ``etcd3gw``; the watch read here, from the gateway's stream on a socket this module
owns, so that ``close`` can shut it under a blocked read and a watch that ends (etcd
restarted) or reports a compaction is noticed, which etcd3gw's watcher does not do."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import re
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.lease import Lease

from kvbridge.errors import ConfigError, RegistryError, WatchCompacted
from kvbridge.supervised import ignored

log = logging.getLogger(__name__)

DEFAULT_TTL = 10  # seconds a registration outlives its instance's last keep-alive
DEFAULT_OP_TIMEOUT = 2.0  # one unary call to etcd; etcd down must not stall anyone long
# The most of one watch message held before its end: a few events, each value bounded by
# its reader (an instance record's 64 KiB, a handshake's max_message_bytes), in base64.
# Past it the watch ends and its reader lists again.
MAX_WATCH_MESSAGE = 8 * 1024 * 1024
_WHITESPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class EtcdEndpoint:
    """Where etcd is and how to reach it: ``etcd://`` plain, ``etcds://`` TLS."""

    host: str
    port: int
    tls: bool = False
    ca_certs: str | None = None
    certfile: str | None = None  # client certificate (etcd's --client-cert-auth)
    keyfile: str | None = None

    @property
    def url(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://{self.host}:{self.port}"


def parse_registry_url(
    url: str,
    *,
    ca_certs: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> EtcdEndpoint:
    """``etcd://HOST:PORT`` or ``etcds://HOST:PORT``; anything else is a ``ConfigError``."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds") or not parts.hostname or parts.path not in ("", "/"):
        raise ConfigError(f"registry {url!r}: expected etcd://HOST:PORT or etcds://HOST:PORT")
    try:
        port = parts.port or 2379
    except ValueError:
        raise ConfigError(f"registry {url!r}: bad port") from None
    if (certfile is None) != (keyfile is None):
        raise ConfigError("the registry's client certificate needs both a cert and a key file")
    tls = parts.scheme == "etcds" or ca_certs is not None or certfile is not None
    return EtcdEndpoint(parts.hostname, port, tls, ca_certs, certfile, keyfile)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


# The gateway's JSON as far as it is read here, checked before use: etcd's int64s come as
# JSON strings (converted leniently); any other shape is refused, never half-read.
class _Header(msgspec.Struct):
    revision: int = 0


class _RangeReply(msgspec.Struct):
    header: _Header
    kvs: list[Any] = []  # each checked on its own (``_checked``): a bad one is ignored


class _Event(msgspec.Struct):
    type: str = "PUT"
    kv: Any = None


class _WatchResult(msgspec.Struct):
    events: list[_Event] = []
    compact_revision: int = 0
    canceled: bool = False
    cancel_reason: str = ""


class _WatchMessage(msgspec.Struct):
    result: _WatchResult = msgspec.field(default_factory=_WatchResult)
    error: Any = None


class _KV(msgspec.Struct):
    key: str
    value: str = ""
    mod_revision: int = 0
    create_revision: int = 0


class _PutReply(msgspec.Struct):
    header: _Header


def _shaped(obj: object, kind: type[msgspec.Struct], what: str) -> Any:
    """``obj`` (the gateway's decoded JSON) as ``kind``, else ``RegistryError``."""
    try:
        return msgspec.convert(obj, kind, strict=False)
    except msgspec.ValidationError as e:
        raise RegistryError(f"etcd: malformed {what}: {e}") from None


def _checked(kv: object, max_value_bytes: int | None) -> tuple[str, bytes, int, int] | None:
    """(key, value, mod_revision, create_revision) of one key-value from the gateway, or None
    (counted) if it is malformed, its key not UTF-8 or its value over ``max_value_bytes``."""
    try:
        item = msgspec.convert(kv, _KV, strict=False)
        raw_key = base64.b64decode(item.key, validate=True)
        value = base64.b64decode(item.value, validate=True)
    except (msgspec.ValidationError, ValueError):
        ignored("registry", "malformed")
        return None
    try:
        key = raw_key.decode()
    except UnicodeDecodeError:
        ignored("registry", "key_not_utf8")
        log.warning("registry: ignoring a key that is not UTF-8: %r", raw_key[:100])
        return None
    if max_value_bytes is not None and len(value) > max_value_bytes:
        ignored("registry", "oversized")
        log.warning("registry: ignoring %s: %d bytes, over the bound of %d", key[:200],
                    len(value), max_value_bytes)
        return None
    return key, value, item.mod_revision, item.create_revision


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes
    revision: int
    created: int = 0  # the key's create_revision (a put's; 0 when etcd gave none)


@dataclass(frozen=True)
class Entry:
    """One key's value and revisions: ``created`` orders keys by when each came to be
    (a key deleted and put again is new), ``revision`` changes with every write."""

    value: bytes
    revision: int  # mod_revision
    created: int  # create_revision


class EtcdRegistry:
    """A small etcd v3 client: what registration, membership and the etcd handshake need.
    Counts its calls (``reads``/``writes``: a benchmark shows none is made per request).
    ``max_watch_message``: the most of one watch message it buffers (``watch_prefix``)."""

    def __init__(self, endpoint: EtcdEndpoint, timeout: float = DEFAULT_OP_TIMEOUT,
                 max_watch_message: int = MAX_WATCH_MESSAGE):
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_watch_message = max_watch_message
        self.reads = 0
        self.writes = 0
        self._client = Etcd3Client(
            host=endpoint.host,
            port=endpoint.port,
            protocol="https" if endpoint.tls else "http",
            ca_cert=endpoint.ca_certs,
            cert_key=endpoint.keyfile,
            cert_cert=endpoint.certfile,
            timeout=timeout,
            api_path="/v3/",
        )  # etcd >= 3.4; skips a version round trip
        self._client.session.trust_env = False  # never through HTTP(S)_PROXY
        self._watch_lock = threading.Lock()
        self._watches: set[socket.socket] = set()
        self._closed = False  # a watch opened after close() would block its reader for good
        self._ssl: ssl.SSLContext | None = None

    def _call(self, fn: Callable[[], object], write: bool) -> object:
        if write:
            self.writes += 1
        else:
            self.reads += 1
        try:
            return fn()
        except (Etcd3Exception, requests.RequestException, KeyError, ValueError) as e:
            raise RegistryError(f"etcd {self.endpoint.url}: {type(e).__name__}: {e}") from None

    def grant(self, ttl: int) -> Lease:
        return self._call(lambda: self._client.lease(ttl), True)  # type: ignore[return-value]

    def keepalive(self, lease: Lease) -> int:
        """The lease's new TTL; <= 0 when etcd no longer knows it (expired)."""
        return self._call(lease.refresh, True)  # type: ignore[return-value]

    def revoke(self, lease: Lease) -> None:
        self._call(lease.revoke, True)

    def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """The store's revision after the put: the key's ``mod_revision`` from then on."""
        body: dict[str, object] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease.id
        reply = self._call(lambda: self._client.post(self._client.get_url("/kv/put"),
                                                     json=body), True)
        put: _PutReply = _shaped(reply, _PutReply, "put reply")
        return put.header.revision

    def delete(self, key: str) -> None:
        self._call(lambda: self._client.delete(key), True)

    def get_prefix(self, prefix: str, max_value_bytes: int | None = None
                   ) -> tuple[dict[str, bytes], int]:
        """Every key under ``prefix`` and the store's revision they were read at. Keys not
        UTF-8 and values over ``max_value_bytes`` are left out and counted (``ignored``):
        etcd holds bytes anyone with write access put there."""
        entries, revision = self.entries(prefix, max_value_bytes)
        return {key: entry.value for key, entry in entries.items()}, revision

    def entries(self, prefix: str, max_value_bytes: int | None = None
                ) -> tuple[dict[str, Entry], int]:
        """As ``get_prefix``, each value with its key's revisions."""
        return self._range({"key": _b64(prefix), "range_end": _prefix_end(prefix)},
                           max_value_bytes)

    def get(self, key: str, max_value_bytes: int | None = None) -> Entry | None:
        """``key`` alone (not the keys it prefixes), or None if it is not there."""
        return self._range({"key": _b64(key)}, max_value_bytes)[0].get(key)

    def _range(self, body: dict[str, str], max_value_bytes: int | None
               ) -> tuple[dict[str, Entry], int]:
        def call() -> dict:
            return self._client.post(self._client.get_url("/kv/range"), json=body)

        reply: _RangeReply = _shaped(self._call(call, False), _RangeReply, "range reply")
        kvs = {}
        for kv in reply.kvs:
            item = _checked(kv, max_value_bytes)
            if item is not None:
                kvs[item[0]] = Entry(*item[1:])
        return kvs, reply.header.revision

    def watch_prefix(self, prefix: str, start_revision: int,
                     max_value_bytes: int | None = None) -> Iterator[WatchEvent]:
        """Events under ``prefix`` from ``start_revision`` on, until the stream ends (or
        ``close``): then ``RegistryError`` (``WatchCompacted`` if that revision is gone;
        also a message past ``max_watch_message`` or two values of ``max_value_bytes``).
        Keys not UTF-8 and values over ``max_value_bytes`` are left out and counted."""
        self.reads += 1
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _prefix_end(prefix),
                "start_revision": start_revision,
            }
        }
        try:
            conn, sock, resp = self._open_watch(body)
        except (http.client.HTTPException, OSError, ValueError) as e:
            raise RegistryError(f"etcd {self.endpoint.url}: watch: {type(e).__name__}: {e}"
                                ) from None
        cap = self.max_watch_message
        if max_value_bytes is not None:  # one value of the largest size always fits
            cap = max(cap, 2 * (max_value_bytes * 4 // 3 + 1024))
        try:
            yield from self._read_stream(resp, max_value_bytes, cap)
        except (http.client.HTTPException, OSError, ValueError) as e:
            raise RegistryError(f"etcd {self.endpoint.url}: watch broke: {e!r}") from None
        finally:
            with self._watch_lock:
                self._watches.discard(sock)
            conn.close()
            sock.close()
        raise RegistryError(f"etcd {self.endpoint.url}: watch stream ended")

    def _open_watch(self, body: dict
                    ) -> tuple[http.client.HTTPConnection, socket.socket, http.client.HTTPResponse]:
        """The watch request sent on a new connection, and its response's head read (both
        within ``timeout``); reads of the stream then wait for events with no timeout."""
        host = self.endpoint.host
        sock = socket.create_connection((host.strip("[]"), self.endpoint.port),
                                        timeout=self.timeout)
        conn = http.client.HTTPConnection(host.strip("[]"), self.endpoint.port)
        try:
            if self.endpoint.tls:
                sock = self._ssl_context().wrap_socket(sock, server_hostname=host.strip("[]"))
            conn.sock = sock
            with self._watch_lock:
                if self._closed:
                    raise RegistryError(f"etcd {self.endpoint.url}: closed")
                self._watches.add(sock)
            conn.request("POST", "/v3/watch", body=json.dumps(body).encode(),
                         headers={"content-type": "application/json"})
            resp = conn.getresponse()
            sock.settimeout(None)
        except BaseException:
            with self._watch_lock:
                self._watches.discard(sock)
            conn.close()
            sock.close()
            raise
        return conn, sock, resp

    def _ssl_context(self) -> ssl.SSLContext:
        """As etcd3gw verifies: the endpoint's CA (else the system's), its client certificate."""
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=self.endpoint.ca_certs)
            if self.endpoint.certfile:
                ctx.load_cert_chain(self.endpoint.certfile, self.endpoint.keyfile)
            self._ssl = ctx
        return self._ssl

    @staticmethod
    def _read_stream(resp: http.client.HTTPResponse, max_value_bytes: int | None,
                     max_message: int) -> Iterator[WatchEvent]:
        """The gateway writes each message as one line of compact JSON: a line is parsed
        once, when its newline comes (each chunk is searched for newlines once, so the time
        is linear in the stream), and the line still open is bounded by ``max_message``."""
        if resp.status != 200:
            text = resp.read(200).decode("utf-8", "replace")
            raise RegistryError(f"watch answered {resp.status}: {text}")
        pending = bytearray()  # the message whose end has not come
        while chunk := resp.read1(65536):
            start = 0
            while (newline := chunk.find(b"\n", start)) >= 0:
                pending += chunk[start:newline]
                start = newline + 1
                line, pending = bytes(pending), bytearray()
                yield from EtcdRegistry._messages(line, max_value_bytes)
            pending += chunk[start:]
            if len(pending) > max_message:
                raise RegistryError(f"watch: a message passed {max_message} bytes without "
                                    "its end (the most one message may take)")
        yield from EtcdRegistry._messages(bytes(pending), max_value_bytes)

    @staticmethod
    def _messages(line: bytes, max_value_bytes: int | None) -> Iterator[WatchEvent]:
        """The events of one line: its JSON messages, one after another."""
        decoder = json.JSONDecoder()
        text = line.decode("utf-8", "replace")
        at = 0
        while (at := _WHITESPACE.match(text, at).end()) < len(text):  # type: ignore[union-attr]
            try:
                msg, at = decoder.raw_decode(text, at)  # from ``at``: no copy of the rest
            except ValueError:
                raise RegistryError(f"watch: a message that is not JSON: "
                                    f"{text[at:at + 100]!r}") from None
            message: _WatchMessage = _shaped(msg, _WatchMessage, "watch message")
            if message.error is not None:
                raise RegistryError(f"watch error: {message.error}")
            result = message.result
            if result.compact_revision > 0:
                raise WatchCompacted(f"compacted at {result.compact_revision}")
            if result.canceled:
                raise RegistryError(f"watch canceled: {result.cancel_reason}")
            for ev in result.events:
                kind = "delete" if ev.type == "DELETE" else "put"
                item = _checked(ev.kv, max_value_bytes if kind == "put" else None)
                if item is not None:
                    yield WatchEvent(kind, *item)

    def close(self) -> None:
        """Ends every watch in progress or opened later (their iterators raise)."""
        with self._watch_lock:
            self._closed = True
            watches = list(self._watches)
        for sock in watches:
            # Shutting the socket down wakes a reader blocked on it (the base class's
            # shutdown: SSLSocket's own would drop its TLS state under the reader).
            with contextlib.suppress(OSError, ValueError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        self._client.session.close()
