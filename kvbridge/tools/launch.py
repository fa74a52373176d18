"""``kvbridge`` sub-commands run as child processes: what the demo, the serve benchmark
and the end-to-end tests all need (start with a log file, wait until healthy, read a
metric, stop politely then firmly)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from kvbridge.net import free_port
from kvbridge.tools.testing.prometheus import metric_total, read_samples

__all__ = ["KVBridgeProcess", "free_port", "read_metric"]


class KVBridgeProcess:
    """``python -m kvbridge.cli ARGS`` with its output in ``log_dir/NAME.log``."""

    def __init__(self, name: str, log_dir: Path, *args: str,
                 env: Mapping[str, str] | None = None, log_level: str = "warning"):
        self.name = name
        self.log = Path(log_dir) / f"{name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvbridge.cli", "--log-level", log_level, *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env))

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, url: str, deadline: float, verify: object = True) -> None:
        """Poll ``url`` until it answers 200: a condition, bounded by ``deadline``."""
        with httpx.Client(verify=verify, trust_env=False) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n"
                                       f"{self.tail()}")
                try:
                    if client.get(url, timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not healthy in time:\n{self.tail()}")
                time.sleep(0.1)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (serve drains held blocks on it), then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def read_metric(client: httpx.Client, url: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets; or one, written ``name{...}``) on
    ``url``'s Prometheus ``/metrics``."""
    return metric_total(read_samples(client, url), name)
