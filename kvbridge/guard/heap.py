"""The heap given back to the OS after bursts of closed connections (glibc's
``malloc_trim``)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
from typing import Any

__all__ = ["TRIMMER"]


class _Trimmer:
    """Gives freed heap back to the OS after a burst of closed connections.

    A closed TLS connection's buffers and SSL state wait for the cycle collector, and once
    freed glibc keeps the pages in its arenas: after a flood of mutual-TLS connections the
    process stayed near its peak for good. A collection and ``malloc_trim`` give them
    back; they take milliseconds, so they run at most once a second and only after
    ``BURST`` connections closed."""

    BURST = 256

    def __init__(self) -> None:
        self._closed = 0
        self._scheduled = False
        self._trim: Any = None
        try:
            self._trim = ctypes.CDLL(None).malloc_trim  # glibc only
        except (OSError, AttributeError):
            pass

    def closed(self) -> None:
        self._closed += 1
        if self._trim is None or self._scheduled or self._closed < self.BURST:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = True
        loop.call_later(1.0, self._run)

    def _run(self) -> None:
        self._closed, self._scheduled = 0, False
        # Closed transports and their protocols reference each other: only the cycle
        # collector frees them (and their SSL objects), and an idle server rarely runs it.
        gc.collect()
        self._trim(0)


TRIMMER = _Trimmer()
