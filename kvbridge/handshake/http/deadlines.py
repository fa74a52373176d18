"""One thread for every pending deadline of the process: ``WATCHDOG.arm(deadline, action)``
calls ``action`` at ``deadline`` unless cancelled first. The http side-channel client arms it
to cut a connection under whatever read is blocked when its deadline passes."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Watchdog:
    """Calls ``action`` at ``deadline`` unless cancelled first: one daemon thread for
    every pending deadline (started on first use)."""

    def __init__(self, name: str = "kvbridge-http-watchdog") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._live: set[int] = set()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # When the thread wakes next by itself: a deadline later than that needs no wake-up
        # (one per fetch would be a thread switch, and a GIL hand-off, on every request).
        self._wakes_at = float("inf")

    def arm(self, deadline: float, action: Callable[[], object]) -> Armed:
        """Call ``action`` at ``deadline`` (``time.monotonic()``) unless the returned
        ``Armed`` is cancelled first."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            seq = next(self._seq)
            heapq.heappush(self._heap, (deadline, seq, action))
            self._live.add(seq)
            if deadline < self._wakes_at:
                self._wakes_at = deadline  # the thread may still be on its way to waiting
                self._cond.notify()
        return Armed(self, seq)

    def cancel(self, seq: int) -> None:
        with self._cond:
            self._live.discard(seq)
            while self._heap and self._heap[0][1] not in self._live:
                heapq.heappop(self._heap)

    @property
    def pending(self) -> int:
        """Deadlines armed and neither fired nor cancelled."""
        with self._cond:
            return len(self._live)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    # Keep sleeping towards the last deadline set: fetches that arm and
                    # cancel one after another then never wake this thread (a deadline
                    # later than that one needs no wake-up).
                    left = self._wakes_at - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                    else:
                        self._wakes_at = float("inf")
                        self._cond.wait()
                    continue
                deadline, seq, action = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._wakes_at = deadline
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                self._live.discard(seq)
            try:
                action()
            except Exception:  # closing a response must not end the watchdog
                log.debug("watchdog action failed", exc_info=True)


class Armed:
    """One armed deadline; ``cancel`` before it fires and its action never runs."""

    def __init__(self, watchdog: Watchdog, seq: int):
        self._watchdog, self._seq = watchdog, seq

    def cancel(self) -> None:
        self._watchdog.cancel(self._seq)


# The process's one watchdog, shared by every http side-channel client.
WATCHDOG = Watchdog()
