"""Start and stop a prefill and a decode 20 times in one process, the decode handshaking
each time: open handles, threads and memory stay flat, and nothing logs an error (NIXL
agents are closed: handles released, remote agents removed, memory deregistered)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.restart_probe import PREFIX

ROUNDS = 20


@pytest.mark.slow
def test_twenty_restarts_leak_nothing():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "restart_probe.py"), str(ROUNDS)],
                         capture_output=True, text=True, timeout=280,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [json.loads(line[len(PREFIX):]) for line in out.stdout.splitlines()
              if line.startswith(PREFIX)]
    assert len(rounds) == ROUNDS
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line or "NIXL_ERR" in line]
    assert errors == []
    warm, last = rounds[2], rounds[-1]  # after the first rounds' one-time imports and pools
    assert last["fds"] <= warm["fds"] + 2, rounds
    assert last["threads"] <= warm["threads"] + 1, rounds
    assert last["rss_mib"] - warm["rss_mib"] < 24, rounds
