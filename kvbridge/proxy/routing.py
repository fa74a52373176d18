"""Which prefill and which decode serve a request.

The router knows every instance (from static lists, from the registry, or both), how many
requests each has in flight through this proxy, and which ones just failed. It picks a
compatible pair (same compat hash; an instance from a static list has none and pairs with
any) by least outstanding requests, ties broken by least recently picked, or by round
robin. An instance that failed is avoided for ``cooldown`` seconds unless nothing else is
left. Thread-safe: the registry's watch thread updates it while requests read it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvbridge.settings import ROUTING_POLICIES

DEFAULT_COOLDOWN = 5.0  # seconds a failed instance is skipped while others are left


@dataclass
class Backend:
    url: str
    role: str  # "prefill", "decode" or "both"
    source: str = "static"  # or "registry"
    engine_id: str | None = None
    epoch: str | None = None
    compat_hash: str | None = None  # None: unknown, pairs with anything
    tp_size: int | None = None
    # registry record fields the proxy shows but does not route on
    info: dict[str, Any] = field(default_factory=dict)
    outstanding: int = 0
    routed: int = 0
    failures: int = 0
    down_until: float = 0.0
    last_pick: int = 0
    added_at: float = field(default_factory=time.monotonic)
    first_routed_at: float | None = None

    def serves(self, role: str) -> bool:
        return self.role in (role, "both")

    def compatible(self, other: Backend) -> bool:
        return None in (self.compat_hash, other.compat_hash) or (
            self.compat_hash == other.compat_hash
        )

    def view(self, now: float) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "source": self.source,
            "engine_id": self.engine_id,
            "epoch": self.epoch,
            "compat_hash": self.compat_hash,
            "tp_size": self.tp_size,
            "outstanding": self.outstanding,
            "routed": self.routed,
            "failures": self.failures,
            "cooling_down": self.down_until > now,
            **self.info,
        }


class Router:
    def __init__(
        self,
        policy: str = "least-outstanding",
        cooldown: float = DEFAULT_COOLDOWN,
        on_added: Callable[[Backend], None] | None = None,
    ):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy {policy!r}: use one of {ROUTING_POLICIES}")
        self.policy = policy
        self.cooldown = cooldown
        self.on_added = on_added
        self._lock = threading.Lock()
        self._backends: dict[str, Backend] = {}  # by API url
        self._seq = itertools.count(1)

    # --- membership ------------------------------------------------------------------

    def add_static(self, role: str, urls: Iterable[str]) -> None:
        for url in urls:
            self.upsert(Backend(url, role))

    def upsert(self, backend: Backend) -> Backend:
        """Add an instance, or update one at the same URL (keeping its counters)."""
        with self._lock:
            old = self._backends.get(backend.url)
            if old is not None:
                restarted = old.epoch is not None and old.epoch != backend.epoch
                for name in (
                    "role",
                    "source",
                    "engine_id",
                    "epoch",
                    "compat_hash",
                    "tp_size",
                    "info",
                ):
                    setattr(old, name, getattr(backend, name))
                if restarted:
                    old.down_until = 0.0  # a new process: its predecessor's failures are moot
                return old
            self._backends[backend.url] = backend
        if self.on_added is not None:
            self.on_added(backend)
        return backend

    def remove(self, url: str) -> Backend | None:
        with self._lock:
            return self._backends.pop(url, None)

    def get(self, url: str) -> Backend | None:
        with self._lock:
            return self._backends.get(url)

    def urls(self, role: str) -> list[str]:
        with self._lock:
            return [b.url for b in self._backends.values() if b.serves(role)]

    def backends(self, role: str | None = None) -> list[Backend]:
        with self._lock:
            return [b for b in self._backends.values() if role is None or b.serves(role)]

    # --- picking ---------------------------------------------------------------------

    def _order(self, candidates: list[Backend], now: float) -> list[Backend]:
        def key(b: Backend) -> tuple:
            healthy = b.down_until <= now
            load = b.outstanding if self.policy == "least-outstanding" else 0
            return (not healthy, load, b.last_pick)

        return sorted(candidates, key=key)

    def pick_pair(
        self, exclude_prefill: Iterable[str] = (), exclude_decode: Iterable[str] = ()
    ) -> tuple[Backend, Backend] | None:
        """The best prefill that has a compatible decode, and the best such decode;
        None if there is no compatible pair outside the exclusions."""
        xp, xd = set(exclude_prefill), set(exclude_decode)
        now = time.monotonic()
        with self._lock:
            prefills = [
                b for b in self._backends.values() if b.serves("prefill") and b.url not in xp
            ]
            decodes = [b for b in self._backends.values() if b.serves("decode") and b.url not in xd]
            for p in self._order(prefills, now):
                matching = [d for d in decodes if p.compatible(d)]
                if matching:
                    d = self._order(matching, now)[0]
                    for b in (p, d):
                        b.last_pick = next(self._seq)
                    return p, d
        return None

    # --- accounting ------------------------------------------------------------------

    def acquire(self, backend: Backend) -> Callable[[], None]:
        """Count a request in flight on ``backend``; call the result once when it ends."""
        with self._lock:
            backend.outstanding += 1
            backend.routed += 1
            if backend.first_routed_at is None:
                backend.first_routed_at = time.monotonic()
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                with self._lock:
                    backend.outstanding -= 1

        return release

    def failed(self, backend: Backend) -> None:
        with self._lock:
            backend.failures += 1
            backend.down_until = time.monotonic() + self.cooldown

    def succeeded(self, backend: Backend) -> None:
        if backend.down_until:
            with self._lock:
                backend.down_until = 0.0

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            return {
                "policy": self.policy,
                "prefill": [b.view(now) for b in self._backends.values() if b.serves("prefill")],
                "decode": [b.view(now) for b in self._backends.values() if b.serves("decode")],
            }
