"""The ``etcd`` method: the prefill publishes each rank's envelope in etcd, decodes read it.

No side-channel socket: the prefill puts the same envelopes http and zmq serve under
``/kvbridge/v1/handshake/HOST:PORT/RANK`` (and ``.../all``), attached to a lease it keeps
alive, so a crashed prefill's metadata expires by itself. ``HOST:PORT`` is the advertised
side-channel address, kept as the peer's name in ``kv_transfer_params``; with port 0 a port
number free on this host is chosen as the name, nothing listens on it.

A decode's client watches the prefix and answers fetches from what the watch delivered
(no etcd read per handshake once a peer is known); a key it has not seen yet is read from
etcd. A restarted prefill publishes its new epoch before it serves a request, so by the
time a request names that epoch the decode already holds it: the re-handshake needs no
failed READ. The envelope is checked exactly as over http/zmq (compat, schema, size).
Access control is etcd's: TLS with client certificates (see docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time

from kvbridge.errors import RegistryError, RetryableHandshakeError
from kvbridge.handshake.base import HandshakeClient, HandshakeServer, MetadataStore, Reply
from kvbridge.metadata import DEFAULT_MAX_MESSAGE_BYTES, Compat
from kvbridge.net import free_port
from kvbridge.registry.etcd_client import DEFAULT_TTL, EtcdEndpoint, EtcdRegistry
from kvbridge.supervised import Supervised

log = logging.getLogger(__name__)

HANDSHAKE_PREFIX = "/kvbridge/v1/handshake/"


def peer_prefix(host: str, port: int) -> str:
    return f"{HANDSHAKE_PREFIX}{host}:{port}/"


def _rank_key(host: str, port: int, tp_rank: int | None) -> str:
    return peer_prefix(host, port) + ("all" if tp_rank is None else str(tp_rank))


class EtcdHandshakeServer(HandshakeServer):
    """Publishes ``store``'s envelopes under a lease until ``stop``."""

    method = "etcd"

    def __init__(
        self,
        store: MetadataStore,
        endpoint: EtcdEndpoint,
        host: str,
        port: int,
        ttl: int = DEFAULT_TTL,
    ):
        self._store = store
        self._registry = EtcdRegistry(endpoint)
        self._host = host
        self._port = port or free_port()
        self._ttl = ttl
        self._lease = None
        self._stop = threading.Event()
        self._published = threading.Event()
        # A republish (the store's payloads changed) not yet put under the current lease.
        self._dirty = threading.Event()
        self._publish_lock = threading.Lock()  # a publish and a republish never interleave
        self._thread = Supervised("kvbridge-etcd-side-channel", self._run, self._stop)

    @property
    def port(self) -> int:
        return self._port

    @property
    def published(self) -> threading.Event:
        return self._published

    def _values(self) -> dict[str, bytes]:
        out = {}
        for rank in [None, *range(self._store.tp_size)]:
            reply = self._store.reply(rank)
            if reply.status == 200:
                out[_rank_key(self._host, self._port, rank)] = reply.body
        return out

    def _publish(self) -> None:
        with self._publish_lock:
            self._dirty.clear()  # the store is read now, after any change so far
            lease = self._registry.grant(self._ttl)
            for key, value in self._values().items():
                self._registry.put(key, value, lease)
            self._lease = lease
        self._published.set()
        log.info(
            "etcd side channel: published %s under lease %x",
            peer_prefix(self._host, self._port),
            lease.id,
        )

    def _run(self) -> None:
        interval = max(self._ttl / 3, 0.2)
        last_ok = due = time.monotonic()
        while not self._stop.is_set():
            # Health is looked at every half second, etcd only when the keep-alive is due
            # (or a republish etcd refused is pending).
            why = None if self._store.health is None else self._store.health()
            if why is not None:  # as http/zmq answer 503: nothing to hand out now
                self._withdraw(why)
            elif self._lease is None or self._dirty.is_set() or time.monotonic() >= due:
                try:
                    if self._lease is None:
                        self._publish()
                    elif self._registry.keepalive(self._lease) <= 0:
                        self._lease = None
                        continue
                    elif self._dirty.is_set():  # a republish etcd refused: again
                        self._put_again()
                    last_ok = time.monotonic()
                    due = last_ok + interval
                except RegistryError as e:
                    log.warning("etcd side channel: %s", e)
                    if time.monotonic() - last_ok > self._ttl:
                        self._lease = None  # expired by now: publish anew when etcd is back
                    due = time.monotonic() + min(interval, 0.5)
            self._stop.wait(min(interval, 0.5))

    def republish(self) -> None:
        """The store's payloads changed (vLLM re-registered its KV cache): put them again
        under the current lease now, so no decode reads the old ones from etcd. If etcd
        refuses, the keep-alive loop tries again; without a lease the next publish reads
        the store as it is."""
        self._dirty.set()
        try:
            self._put_again()
        except RegistryError as e:
            log.warning("etcd side channel: republish delayed: %s", e)

    def payloads_changed(self, payloads: dict[tuple[int, int], bytes]) -> None:
        self.republish()

    def _put_again(self) -> None:
        with self._publish_lock:
            lease = self._lease
            if lease is None or not self._dirty.is_set():
                return
            self._dirty.clear()
            try:
                for key, value in self._values().items():
                    self._registry.put(key, value, lease)
            except RegistryError:
                self._dirty.set()
                raise
        log.info("etcd side channel: republished %s", peer_prefix(self._host, self._port))

    def _withdraw(self, why: str) -> None:
        lease, self._lease = self._lease, None
        self._published.clear()
        if lease is not None:
            log.warning("etcd side channel: withdrawing the metadata: %s", why)
            try:
                self._registry.revoke(lease)
            except RegistryError as e:
                log.warning("etcd side channel: not revoked (expires by itself): %s", e)

    def start(self) -> None:
        self._thread.start()

    def abandon(self, timeout: float = 10) -> None:
        """Stop keeping the lease alive without revoking it, as a crash would: the
        metadata stays in etcd until the lease's TTL runs out."""
        self._stop.set()
        self._thread.join(timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._registry.revoke(lease)
            except RegistryError as e:
                log.warning("etcd side channel: not revoked (expires by itself): %s", e)
        self._registry.close()


class EtcdHandshakeClient(HandshakeClient):
    method = "etcd"
    records_lag = True

    def __init__(
        self,
        timeout: float,
        expected: Compat | None,
        token: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        endpoint: EtcdEndpoint,
    ):
        super().__init__(timeout, expected, token, max_message_bytes)
        self._registry = EtcdRegistry(endpoint, timeout=min(timeout, 2.0))
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._thread = Supervised("kvbridge-etcd-watch", self._watch, self._stop).start()

    def _watch(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            try:
                kvs, revision = self._registry.get_prefix(HANDSHAKE_PREFIX, self.max_message_bytes)
                with self._lock:
                    self._cache = dict(kvs)
                self._synced.set()
                delay = 0.1
                for ev in self._registry.watch_prefix(HANDSHAKE_PREFIX, revision + 1,
                                                      self.max_message_bytes):
                    with self._lock:
                        if ev.kind == "put":
                            self._cache[ev.key] = ev.value
                        else:
                            self._cache.pop(ev.key, None)
            except RegistryError:
                self._synced.clear()
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)

    def watched(self) -> set[str]:
        """The keys the watch holds now (a copy)."""
        with self._lock:
            return set(self._cache)

    @property
    def reads(self) -> int:
        """etcd calls made (the watch's list and stream included)."""
        return self._registry.reads

    def _request(self, host: str, port: int, tp_rank: int | None, deadline: float) -> Reply:
        key = _rank_key(host, port, tp_rank)
        with self._lock:
            body = self._cache.get(key)
        if body is None:  # not seen by the watch (yet): ask etcd itself
            try:
                body = self._registry.get_prefix(key, self.max_message_bytes)[0].get(key)
            except RegistryError as e:
                raise RetryableHandshakeError(str(e)) from None
            if body is None:
                raise RetryableHandshakeError(f"nothing published at {key} (prefill not up yet?)")
        return Reply(200, body)  # checked (size, schema, compat) by ``fetch``

    def close(self) -> None:
        self._stop.set()
        self._registry.close()
        self._thread.join(timeout=5)
