"""The proxy's live view of the fleet, kept by watching the registry.

One thread lists the instances once, then follows etcd's watch from the next revision:
an instance appears in the router within the watch's latency, with no polling loop. If
etcd goes away the view is kept as it was and the thread lists and watches again when it
is back. A record that disappears is dropped at once if the instance does not answer its
``/health``; one that still answers (its lease ran out while etcd was paused, say) is kept
for ``grace`` seconds, in which its registrar normally writes it again.

Records are bytes from outside until checked: a key that is not UTF-8, a record over
``MAX_RECORD_BYTES``, a malformed one, or one stored under another instance's key is
ignored and counted (``kvbridge_ignored_inputs_total``). An instance's view comes from the
oldest record naming its URL, by etcd's creation revision of its key (not by key order,
nor by which the proxy saw first): a record created later naming the same URL does not
rewrite it, and when the oldest goes the view comes from the next. The thread is supervised
(``kvbridge.supervised``): an unexpected error restarts it, with backoff.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx
import msgspec

from kvbridge.errors import RegistryError, WatchCompacted
from kvbridge.proxy.routing import Backend, Router
from kvbridge.registry.etcd_client import Entry, EtcdRegistry
from kvbridge.registry.record import INSTANCES_PREFIX, InstanceRecord, instance_key
from kvbridge.supervised import Supervised, ignored

log = logging.getLogger(__name__)

DEFAULT_GRACE = 15.0
# A record is a few hundred bytes; anything much larger is not one of ours.
MAX_RECORD_BYTES = 64 * 1024


def backend_of(record: InstanceRecord) -> Backend:
    info = {
        "model": record.model,
        "load": record.load,
        "side_channel": None
        if record.side_channel_port is None
        else f"{record.handshake_method}://{record.side_channel_host}:{record.side_channel_port}",
    }
    return Backend(
        record.api_url.rstrip("/"),
        record.role,
        "registry",
        record.engine_id,
        record.epoch,
        record.compat_hash,
        record.tp_size,
        info,
    )


class Membership:
    """Feeds ``router`` from the registry until ``close``."""

    def __init__(
        self,
        registry: EtcdRegistry,
        router: Router,
        *,
        prefix: str = INSTANCES_PREFIX,
        grace: float = DEFAULT_GRACE,
        verify: object = True,
        probe_timeout: float = 1.0,
    ):
        self.registry = registry
        self.router = router
        self.prefix = prefix
        self.grace = grace
        self.connected = threading.Event()  # listed and watching
        self.synced = threading.Event()  # listed at least once
        # Since when (monotonic) the view is the last one known, and why: the watch broke
        # (an endless message included) and etcd has not been listed again yet.
        self.stale_since: float | None = None
        self.last_error: str | None = None
        self.events = 0
        # registry key -> (record, its key's create_revision): the oldest record naming a
        # URL is that instance's view until it goes; another record naming the same URL (a
        # stray, or a restart under a new engine id) is ignored while that one stands
        self._records: dict[str, tuple[InstanceRecord, int]] = {}
        self._orphans: dict[str, float] = {}  # url -> when its record went
        self._lock = threading.Lock()  # the watch thread and the orphans' timers
        self._stop = threading.Event()
        self._probe = httpx.Client(
            verify=verify,
            timeout=probe_timeout,  # type: ignore[arg-type]
            trust_env=False,
        )
        self._thread = Supervised("kvbridge-membership", self._run, self._stop)
        self._started = time.monotonic()

    def start(self) -> Membership:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.registry.close()
        self._thread.join(timeout=5)
        self._probe.close()

    def staleness(self) -> dict[str, object]:
        """For the fleet view: is it the registry's current one, and if not since when
        and why (``connected`` false: routing goes on with the last view)."""
        since = self.stale_since
        if since is None and not self.connected.is_set():
            since = self._started  # never listed yet
        return {"connected": self.connected.is_set(), "stale": since is not None,
                "stale_seconds": None if since is None else round(time.monotonic() - since, 3),
                "last_error": self.last_error}

    def _run(self) -> None:
        try:
            self._follow()
        finally:
            self.connected.clear()  # ended or failed: not watching until listed again

    def _follow(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            try:
                records, revision = self.registry.entries(self.prefix, MAX_RECORD_BYTES)
                self._resync(records)
                self.synced.set()
                self.stale_since = None
                self.connected.set()
                delay = 0.1
                for ev in self.registry.watch_prefix(self.prefix, revision + 1,
                                                     MAX_RECORD_BYTES):
                    self.events += 1
                    if ev.kind == "put":
                        self._put(ev.key, ev.value, ev.created or ev.revision)
                    else:
                        self._gone(ev.key)
            except WatchCompacted as e:
                log.info("registry watch: %s; listing again", e)
            except RegistryError as e:
                if self._stop.is_set():
                    break
                if self.connected.is_set():
                    log.warning("registry unreachable, routing on the last view: %s", e)
                self.connected.clear()
                self.last_error = str(e)
                if self.stale_since is None:
                    self.stale_since = time.monotonic()
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)
            self._expire_orphans()

    def _put(self, key: str, value: bytes, created: int) -> None:
        try:
            record = InstanceRecord.decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            ignored("registry", "malformed")
            log.warning("registry: ignoring malformed record %s: %s", key, str(e)[:200])
            return
        if key != instance_key(record, self.prefix):
            ignored("registry", "key_mismatch")
            log.warning("registry: ignoring the record at %s: it names engine %s as %s", key,
                        record.engine_id[:64], record.role)
            return
        url = record.api_url.rstrip("/")
        with self._lock:
            old = self._records.get(key)
            self._records[key] = (record, created)
            owner = self._owner(url)
            self._orphans.pop(url, None)
        if owner is record:
            self.router.upsert(backend_of(record))
        else:
            ignored("registry", "url_taken")
            log.warning("registry: ignoring %s: %s is %s's (engine %s), an older record",
                        key, url, owner and instance_key(owner, self.prefix),
                        owner and owner.engine_id[:64])
        if old is not None and old[0].api_url.rstrip("/") != url:
            self._reassign(old[0].api_url.rstrip("/"))

    def _owner(self, url: str) -> InstanceRecord | None:
        """The record naming ``url`` whose key etcd created first (lock held): key order
        is the writer's choice, creation order is not."""
        naming = [(created, key, record) for key, (record, created) in self._records.items()
                  if record.api_url.rstrip("/") == url]
        return min(naming, key=lambda n: n[:2])[2] if naming else None

    def _resync(self, entries: dict[str, Entry]) -> None:
        for key in [k for k in self._records if k not in entries]:
            self._gone(key)
        # oldest first, so a URL's owner is put before the records it outranks
        for key, entry in sorted(entries.items(),
                                 key=lambda kv: (kv[1].created or kv[1].revision, kv[0])):
            self._put(key, entry.value, entry.created or entry.revision)

    def _gone(self, key: str) -> None:
        with self._lock:
            item = self._records.pop(key, None)
        if item is not None:
            self._reassign(item[0].api_url.rstrip("/"))

    def _reassign(self, url: str) -> None:
        """``url`` lost a record: the view comes from the next record naming it, if any;
        else the instance is dropped (or kept a while if it still answers)."""
        with self._lock:
            owner = self._owner(url)
        if owner is not None:
            self.router.upsert(backend_of(owner))
            return
        if self.router.get(url) is None:
            return
        if self._alive(url):
            log.info("registry: %s deregistered but answers; keeping it %gs", url, self.grace)
            with self._lock:
                self._orphans[url] = time.monotonic()
            timer = threading.Timer(self.grace, self._expire_orphans)
            timer.daemon = True  # must not hold the proxy's exit
            timer.start()
        else:
            self.router.remove(url)
            log.info("registry: %s gone", url)

    def _alive(self, url: str) -> bool:
        try:
            return self._probe.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _expire_orphans(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [
                url
                for url, since in self._orphans.items()
                if now - since >= self.grace and self._owner(url) is None
            ]
            for url in expired:
                del self._orphans[url]
        for url in expired:
            self.router.remove(url)
            log.info("registry: %s not registered again within %gs; dropped", url, self.grace)
