"""Keeping one instance's record in etcd under a lease while the instance is up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
from etcd3gw.lease import Lease

from kvbridge.errors import ConfigError, RegistryError
from kvbridge.registry.etcd_client import DEFAULT_OP_TIMEOUT, DEFAULT_TTL, EtcdRegistry
from kvbridge.registry.record import INSTANCES_PREFIX, InstanceRecord, instance_key
from kvbridge.supervised import Supervised

log = logging.getLogger(__name__)


class Registrar:
    """Keeps one instance's record in etcd under a lease while the instance is up.

    A thread grants the lease, puts the record, and keeps the lease alive every third
    of the TTL (rewriting the record only when it changed, e.g. its load). With each
    keep-alive it reads its key back: if anyone else wrote or deleted it since its own
    write (the key's ``mod_revision`` moved), the foreign write is logged and counted
    (``foreign_writes``) and the record written again. etcd down: the
    instance keeps serving; the lease is re-granted and the record re-put once etcd is
    back. ``deregister`` revokes the lease, so the record goes at once, not at the TTL.
    ``health`` (None: healthy, else why not) is asked before every keep-alive: an instance
    that cannot serve is withdrawn (lease revoked) until it can again.
    """

    def __init__(
        self,
        registry: EtcdRegistry,
        record: Callable[[], InstanceRecord],
        ttl: int = DEFAULT_TTL,
        prefix: str = INSTANCES_PREFIX,
        health: Callable[[], str | None] | None = None,
    ):
        if ttl < 1:
            raise ConfigError(f"registry TTL must be at least 1 second, got {ttl}")
        self.registry = registry
        self.ttl = int(ttl)
        self.prefix = prefix
        self.registrations = 0  # how many times the record was (re-)written with a new lease
        self.foreign_writes = 0  # writes or deletes of its key by others, undone
        self._record = record
        self._health = health
        self._lease: Lease | None = None
        self._written: InstanceRecord | None = None
        self._revision = 0  # the key's mod_revision after this registrar's last write
        self._foreign_seen: tuple[int, int | None] | None = None  # the last one logged
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._thread = Supervised("kvbridge-registrar", self._run, self._stop)

    @property
    def key(self) -> str:
        return instance_key(self._record(), self.prefix)

    @property
    def lease(self) -> Lease | None:
        return self._lease

    @property
    def running(self) -> bool:
        """Its keep-alive thread runs (started, not stopped)."""
        return self._thread.is_alive()

    def start(self) -> Registrar:
        self._thread.start()
        return self

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def _register(self) -> None:
        lease = self.registry.grant(self.ttl)
        record = self._record()
        self._revision = self.registry.put(instance_key(record, self.prefix), record.encode(),
                                           lease)
        self._lease, self._written = lease, record
        self.registrations += 1
        self._registered.set()
        log.info(
            "registered %s in %s (lease %x, ttl %ds)",
            instance_key(record, self.prefix),
            self.registry.endpoint.url,
            lease.id,
            self.ttl,
        )

    def _run(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        last_ok = due = time.monotonic()
        failing = False
        while not self._stop.is_set():
            # Health is looked at every half second, etcd only when the keep-alive is due.
            why = None if self._health is None else self._health()
            if why is not None:
                self._withdraw(why)
            elif self._lease is None or time.monotonic() >= due:
                try:
                    if self._lease is None:
                        self._register()
                    elif self.registry.keepalive(self._lease) <= 0:
                        log.warning("registry lease expired; registering again")
                        self._lease = None
                        self._registered.clear()
                        continue
                    else:
                        self._keep_record()
                    last_ok, failing = time.monotonic(), False
                    due = last_ok + interval
                except RegistryError as e:
                    if not failing:
                        log.warning("registry unreachable, still serving: %s", e)
                    failing = True
                    if self._lease is not None and time.monotonic() - last_ok > self.ttl:
                        self._lease = None  # it has expired by now: register anew when back
                        self._registered.clear()
                    due = time.monotonic() + min(interval, 0.5)
            self._stop.wait(min(interval, 0.5))

    def _keep_record(self) -> None:
        """Writes the record again if it changed, or if someone else wrote its key."""
        assert self._lease is not None
        record = self._record()
        key = instance_key(record, self.prefix)
        foreign = self._foreign_write(key)
        if record != self._written or foreign:
            self._revision = self.registry.put(key, record.encode(), self._lease)
            self._written = record
            if foreign:
                log.info("registry: %s written again", key)

    def _foreign_write(self, key: str) -> bool:
        """The key was written or deleted by another since this registrar wrote it (logged
        and counted once per foreign write, even if writing the record back fails)."""
        entry = self.registry.get(key)
        if entry is not None and entry.revision == self._revision:
            return False
        seen = (self._revision, None if entry is None else entry.revision)
        if seen == self._foreign_seen:
            return True
        self._foreign_seen = seen
        self.foreign_writes += 1
        log.warning("registry: %s was %s by someone else; writing this instance's record "
                    "back", key, "deleted" if entry is None else
                    f"overwritten at revision {entry.revision} with {_summary(entry.value)}")
        return True

    def _withdraw(self, why: str) -> None:
        lease, self._lease = self._lease, None
        self._registered.clear()
        if lease is None:
            return
        log.warning("withdrawing the registration: %s", why)
        try:
            self.registry.revoke(lease)
        except RegistryError as e:
            log.warning("could not revoke (the lease ends by itself): %s", e)

    def deregister(self, timeout: float = DEFAULT_OP_TIMEOUT) -> bool:
        """Stop keeping the lease and revoke it (the record is deleted with it)."""
        self._stop.set()
        self._thread.join(timeout=timeout + self.registry.timeout)
        lease, self._lease = self._lease, None
        self._registered.clear()
        if lease is None:
            return False
        try:
            self.registry.revoke(lease)
            return True
        except RegistryError as e:
            log.warning("could not deregister (the lease ends by itself): %s", e)
            return False


def _summary(value: bytes) -> str:
    """A foreign value for a log line: the record it claims to be, else its first bytes."""
    try:
        r = InstanceRecord.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return f"{len(value)} bytes that are not a record: {value[:80]!r}"
    return (f"a record of engine {r.engine_id[:64]!r} ({r.role}, epoch {r.epoch[:64]!r}) "
            f"at {r.api_url[:200]!r}")
