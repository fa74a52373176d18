"""Background threads that never die silently, and outside inputs they ignore, counted.

``Supervised`` runs a loop function in a daemon thread. The loop handles the failures it
expects (etcd unreachable, say) itself; anything else it raises is logged once with its
cause (the traceback of the first failure of a streak; later identical ones at debug
level), and the loop is started again after a backoff (0.1 s doubling to 30 s, back to
0.1 s once a run lasted a minute). While it waits to restart, or while its ``liveness``
says what it keeps going does not answer, the thread is *down*:
``down()`` names it and why, ``/health`` of the process answers 503 saying so, and the
metrics ``kvbridge_background_thread_up`` and ``kvbridge_background_thread_restarts_total``
show it.

``ignored(source, reason)`` counts an input from outside that was dropped instead of
trusted (a registry key that is not UTF-8, a record over the size bound, a malformed
one): ``kvbridge_ignored_inputs_total{source, reason}``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["BackgroundCollector", "Supervised", "down", "ignored", "ignored_counts"]

log = logging.getLogger(__name__)

MIN_BACKOFF = 0.1
MAX_BACKOFF = 30.0
HEALTHY_RUN = 60.0  # a run this long resets the backoff

_THREADS: weakref.WeakSet[Supervised] = weakref.WeakSet()
_IGNORED: dict[tuple[str, str], int] = {}
_IGNORED_LOCK = threading.Lock()


class Supervised:
    """``loop()`` in a daemon thread named ``name``, restarted with backoff whenever it
    raises, until ``stop`` is set (then a return or an exception ends it for good).

    ``loop`` returning normally while ``stop`` is not set ends the thread too (a one-shot
    job that finished).

    ``liveness``, if given, says while the thread runs why what it keeps going is down
    anyway (a process it supervises starting, or not answering): the thread counts as
    down then too."""

    def __init__(self, name: str, loop: Callable[[], None], stop: threading.Event,
                 liveness: Callable[[], str | None] | None = None):
        self.name = name
        self._loop = loop
        self._stop = stop
        self._liveness = liveness
        self.restarts = 0
        self._failed: str | None = None  # set while waiting to restart
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _THREADS.add(self)

    def start(self) -> Supervised:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def down_reason(self) -> str | None:
        """Why it is down (None: up): its failure while it waits to restart, else what
        ``liveness`` says while it runs."""
        if self._failed is not None:
            return self._failed
        if self._liveness is None or not self.is_alive() or self._stop.is_set():
            return None
        return self._liveness()

    @property
    def up(self) -> bool:
        return self.down_reason is None

    def _run(self) -> None:
        delay = MIN_BACKOFF
        last_cause: str | None = None
        while True:
            started = time.monotonic()
            try:
                self._loop()
                return
            except Exception as e:  # noqa: BLE001 - the point: nothing ends the thread silently
                if self._stop.is_set():
                    return
                cause = f"{type(e).__name__}: {e}"
                if cause != last_cause:
                    log.error("background thread %s failed (%s); restarting it in %.1fs",
                              self.name, cause, delay, exc_info=True)
                else:
                    log.debug("background thread %s failed again: %s", self.name, cause)
                last_cause = cause
                self._failed = cause[:300]
            if time.monotonic() - started >= HEALTHY_RUN:
                delay = MIN_BACKOFF
            if self._stop.wait(delay):
                self._failed = None
                return
            delay = min(delay * 2, MAX_BACKOFF)
            self.restarts += 1
            self._failed = None


def down() -> dict[str, str]:
    """Supervised threads of this process waiting to restart, and why."""
    return {t.name: t.down_reason for t in list(_THREADS) if t.down_reason is not None}


def ignored(source: str, reason: str) -> None:
    with _IGNORED_LOCK:
        _IGNORED[(source, reason)] = _IGNORED.get((source, reason), 0) + 1


def ignored_counts() -> dict[tuple[str, str], int]:
    with _IGNORED_LOCK:
        return dict(_IGNORED)


class BackgroundCollector:
    """Prometheus collector of this process's supervised threads and ignored inputs."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("kvbridge_background_thread_up",
                               "1 while a supervised background thread runs, 0 while it "
                               "waits to restart after a failure", labels=["thread"])
        restarts = CounterMetricFamily("kvbridge_background_thread_restarts",
                                       "Restarts of a supervised background thread after a "
                                       "failure", labels=["thread"])
        seen: dict[str, tuple[int, int]] = {}
        for t in list(_THREADS):
            was_up, n = seen.get(t.name, (1, 0))
            seen[t.name] = (was_up and int(t.up), n + t.restarts)
        for name, (is_up, n) in sorted(seen.items()):
            up.add_metric([name], is_up)
            restarts.add_metric([name], n)
        dropped = CounterMetricFamily("kvbridge_ignored_inputs",
                                      "Inputs from outside (registry keys and records) "
                                      "ignored as invalid, by source and reason",
                                      labels=["source", "reason"])
        for (source, reason), n in sorted(ignored_counts().items()):
            dropped.add_metric([source, reason], n)
        yield up
        yield restarts
        yield dropped
