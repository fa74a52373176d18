"""Helpers shared by the benchmarks: child processes, /proc readings, ``--quick`` sizes,
plots. Certificates come from ``kvbridge.tools.testing.certs``, the load from
``kvbridge.tools.bench.load``."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

from kvbridge.tools.testing.procfs import cpu_seconds, instance_rss_mib


def progress(msg: str) -> None:
    """Progress of a long run: stderr, so stdout stays the summary."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Child:
    """A ``python -m kvbridge.tools.bench.peer ROLE ...`` process.

    It prints one JSON line once ready; further commands are lines on stdin answered
    by one JSON line each; it exits when stdin closes.
    """

    def __init__(self, role: str, *args: str, start_timeout: float = 120.0):
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.tools.bench.peer", role, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info: dict[str, Any] = self._read(start_timeout)
        self.pid = self.proc.pid

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"bench peer {self.role} gave no answer (exit "
                               f"{self.proc.poll()})")
        return json.loads(line)

    def command(self, line: str, timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def stats(self) -> dict[str, float]:
        return proc_stats(self.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def proc_stats(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) and peak RSS (``VmHWM``, MiB) of a process, and the
    current RSS of its instance (``kvbridge.tools.testing.procfs.instance_rss_mib``)."""
    out = {"cpu_seconds": cpu_seconds(pid), "peak_rss_mib": float("nan"), "rss_mib": float("nan")}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                out["peak_rss_mib"] = int(line.split()[1]) / 1024
    out["rss_mib"] = instance_rss_mib(pid)
    return out


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def apply_quick(args: Any, sizes: dict[str, Any]) -> None:
    """``--quick``: set a benchmark's tiny smoke-test ``sizes`` (its ``QUICK``) on ``args``."""
    if getattr(args, "quick", False):
        for name, value in sizes.items():
            setattr(args, name, value)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def idle_cpu(pid: int, seconds: float = 1.0) -> float:
    """CPU seconds per second a process uses while we send it nothing."""
    a = proc_stats(pid)["cpu_seconds"]
    time.sleep(seconds)
    return (proc_stats(pid)["cpu_seconds"] - a) / seconds
