"""Readings of ``/proc`` shared by tests and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["group_cpu_seconds", "instance_rss_mib"]


def _vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # a zombie has no VmRSS line


def instance_rss_mib(pid: int) -> float:
    """Resident memory (MiB) of an instance: the process ``pid`` and its direct children
    (a ``kvbridge serve``'s TP workers), as they are now."""
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(c) for c in children.read_text().split()]
    total = 0
    for p in pids:
        try:
            total += _vm_rss_kib(p)
        except FileNotFoundError:  # a child that exited meanwhile
            if p == pid:
                raise
    return total / 1024


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (utime + stime, every thread) used so far by the live processes of the
    process group ``pgid`` (a vLLM server: API server, engine core, workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the fields after the command name (which may hold spaces and parentheses)
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])
    return total / tick
