"""The audit log: one JSON line per decision, with refusals bounded.

Anyone who can open a connection can be refused, as fast as they can send: refused lines
are rate-limited per outcome (``refused 401``, ``refused 403``, ...) by a token bucket
(``burst`` lines at once, then ``rate`` per second). What the bucket drops is counted and
said in one line, ``{"result": "suppressed", "outcome": ..., "count": N}``, written before
the next admitted line of that outcome, at most ``interval`` seconds after the first one
dropped (on the next write of any line), and on ``close``. Other outcomes (fetches,
releases) come from callers that passed the checks and are never dropped.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbridge.errors import ConfigError

__all__ = ["AUDIT_BURST", "AUDIT_INTERVAL", "AUDIT_RATE", "AuditLog"]

AUDIT_BURST = 100  # refused lines of one outcome written at once
AUDIT_RATE = 10.0  # then this many per second
AUDIT_INTERVAL = 10.0  # seconds at most between a dropped line and the line counting it


def _timestamp() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"


class AuditLog:
    """JSON lines appended to ``path``, one per decision (thread-safe)."""

    def __init__(self, path: str, *, burst: int = AUDIT_BURST, rate: float = AUDIT_RATE,
                 interval: float = AUDIT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        try:
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as us
        except OSError as e:
            raise ConfigError(f"cannot open the audit log {path}: {e.strerror}") from None
        self._lock = threading.Lock()
        self._burst, self._rate, self._interval, self._clock = burst, rate, interval, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # outcome -> (tokens, when)
        self._dropped: dict[str, tuple[int, float]] = {}  # outcome -> (count, first drop)
        self.lines = 0
        self.suppressed = 0

    def write(self, **fields: Any) -> None:
        result = fields.get("result")
        limited = isinstance(result, str) and result.startswith("refused")
        line = json.dumps({"time": _timestamp(), **fields}, separators=(",", ":"), default=str)
        with self._lock:
            if self._file.closed:
                return
            now = self._clock()
            if limited and not self._take(result, now):
                count, first = self._dropped.get(result, (0, now))
                self._dropped[result] = (count + 1, first)
                self.suppressed += 1
            else:
                if limited:
                    self._summarize(result)
                self._put(line)
            for outcome, (_, first) in list(self._dropped.items()):
                if now - first >= self._interval:
                    self._summarize(outcome)

    def _take(self, outcome: str, now: float) -> bool:
        tokens, then = self._buckets.get(outcome, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - then) * self._rate)
        ok = tokens >= 1.0
        self._buckets[outcome] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def _summarize(self, outcome: str) -> None:
        count, _ = self._dropped.pop(outcome, (0, 0.0))
        if count:
            self._put(json.dumps({"time": _timestamp(), "result": "suppressed",
                                  "outcome": outcome, "count": count}, separators=(",", ":")))

    def _put(self, line: str) -> None:
        self._file.write(line + "\n")
        self.lines += 1

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            for outcome in list(self._dropped):
                self._summarize(outcome)
            self._file.close()
