"""The connections of each server, and the counts every guard of the process keeps (open,
evicted at the cap, timed out, dropped), mirrored from another process where it runs one."""

from __future__ import annotations

import logging
import weakref
from typing import Protocol

from kvbridge.guard.heap import TRIMMER
from kvbridge.settings import ConnectionBudget

__all__ = ["GUARDS", "ConnectionGuard", "Guarded", "GuardMirror", "GuardStats", "guard_stats"]

log = logging.getLogger("kvbridge.guard")


class Guarded(Protocol):
    """A guarded connection, as its guard sees it (``kvbridge.guard.protocol``)."""

    def _guard_state(self) -> str: ...

    def _guard_close(self) -> None: ...


class ConnectionGuard:
    """The connections of one server, least recently active first."""

    def __init__(self, budget: ConnectionBudget, name: str) -> None:
        self.budget = budget
        self.name = name
        self._conns: dict[Guarded, None] = {}
        self.evicted = 0  # closed to make room at the cap
        self.timed_out = 0  # closed for a missed first-byte, head or body deadline
        self.dropped = 0  # closed for a message over the limits (zmq side channel)
        GUARDS.add(self)

    def __len__(self) -> int:
        return len(self._conns)

    def admit(self, conn: Guarded) -> None:
        if len(self._conns) >= self.budget.max_connections:
            victim = None
            for old in self._conns:  # least recently active first
                state = old._guard_state()
                if state == "idle":
                    victim = old
                    break
                if state == "head" and victim is None:
                    victim = old  # a head still incomplete: closed only if none is idle
            if victim is not None:
                self.evicted += 1
                if self.evicted == 1 or self.evicted % 1000 == 0:
                    log.warning(
                        "%s: %d connections (the cap): closed the one idle the longest (%d so far)",
                        self.name,
                        len(self._conns),
                        self.evicted,
                    )
                self.remove(victim)
                victim._guard_close()
        self._conns[conn] = None

    def touch(self, conn: Guarded) -> None:
        """``conn`` just became idle: it is now the newest idle connection."""
        if self._conns.pop(conn, False) is None:
            self._conns[conn] = None

    def remove(self, conn: Guarded) -> None:
        if self._conns.pop(conn, False) is None:
            TRIMMER.closed()


GUARDS: weakref.WeakSet[ConnectionGuard] = weakref.WeakSet()


GuardStats = tuple[int, int, int, int]  # open, evicted, timed_out, dropped


def guard_stats() -> dict[str, GuardStats]:
    """Every live guard of this process, summed by server name (what a side-channel
    process reports to its parent)."""
    out: dict[str, GuardStats] = {}
    for g in list(GUARDS):
        o, e, t, d = out.get(g.name, (0, 0, 0, 0))
        out[g.name] = (o + len(g), e + g.evicted, t + g.timed_out, d + g.dropped)
    return out


class GuardMirror:
    """Another process's guard, as that process reports it (the side-channel process):
    counted by ``GuardCollector`` here. Its counters stay monotonic across that
    process's restarts (a new one counts from zero). Keep a reference: guards are held
    weakly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._open = 0
        self._base = (0, 0, 0)
        self._last = (0, 0, 0)
        GUARDS.add(self)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._open

    def update(self, stats: GuardStats) -> None:
        self._open, *last = stats
        self._last = (last[0], last[1], last[2])

    def restarted(self) -> None:
        """The process restarted: what it counted so far stays counted."""
        self._base = tuple(b + x for b, x in zip(self._base, self._last, strict=True))
        self._last, self._open = (0, 0, 0), 0

    evicted = property(lambda self: self._base[0] + self._last[0])
    timed_out = property(lambda self: self._base[1] + self._last[1])
    dropped = property(lambda self: self._base[2] + self._last[2])
