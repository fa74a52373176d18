"""Readings of ``/proc`` shared by tests and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["children", "cpu_seconds", "gone", "group_cpu_seconds", "group_processes",
           "instance_rss_mib", "listening", "status_field"]


def status_field(task: str, name: str) -> str:
    """The first word of field ``name`` of ``/proc/<task>/status`` (``task``: ``"1234"``,
    or ``"self/task/1235"`` for a thread): ``FDSize``, ``Cpus_allowed_list``, ..."""
    for line in Path(f"/proc/{task}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split()[1]
    raise KeyError(f"/proc/{task}/status has no {name}")


def _vm_rss_kib(pid: int) -> int:
    try:
        return int(status_field(str(pid), "VmRSS"))
    except KeyError:
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


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (which may hold spaces and
    parentheses): ``[0]`` state, ``[1]`` parent, ``[2]`` process group, ``[11]`` utime,
    ``[12]`` stime."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (utime + stime, every thread) the process ``pid`` used so far."""
    rest = _stat_fields(pid)
    return (int(rest[11]) + int(rest[12])) / _CLK_TCK


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (utime + stime, every thread) used so far by the live processes of the
    process group ``pgid`` (a vLLM server: API server, engine core, workers)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = _stat_fields(entry.name)
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        if int(rest[2]) == pgid:
            total += int(rest[11]) + int(rest[12])
    return total / _CLK_TCK


def gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan nobody here reaps). Every thread
    counts: a thread group's leader shows "Z" as soon as it exits, while its other threads
    may still be running down and holding the process's files (its sockets)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    for task in tasks:
        try:
            if _stat_fields(f"{pid}/task/{task}")[0] not in ("Z", "X"):
                return False
        except (FileNotFoundError, ProcessLookupError):  # that thread just ended
            continue
    return True


def group_processes(pgid: int, needle: str) -> list[tuple[int, int]]:
    """(pid, parent pid) of the live processes of group ``pgid`` whose command line holds
    ``needle`` (a vLLM server's side-channel process: ``kvbridge.handshake.process.child``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = _stat_fields(entry.name)
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        if int(rest[2]) == pgid and rest[0] not in ("Z", "X") and needle in cmdline:
            found.append((int(entry.name), int(rest[1])))
    return found


def children(pid: int, needle: str = "") -> list[int]:
    """The live child processes of ``pid`` whose command line holds ``needle``."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids = [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        for child in pids:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            except FileNotFoundError:
                continue
            if needle in cmdline.decode() and not gone(child):
                found.append(child)
    return found


_TCP_LISTEN = "0A"


def listening(port: int) -> bool:
    """Whether any socket on this host (this network namespace) listens on TCP ``port``,
    whoever holds it. Why not try to bind it: an unrelated outgoing connection that drew the
    same port as its local port makes a bind fail too, on a busy host."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == _TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False
