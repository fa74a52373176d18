"""``make demo``'s command, as a user runs it: three processes over TLS with a token, and
every answer equal to the decode's own computation without transferred KV."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_demo_runs_and_every_answer_matches():
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "demo", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.rstrip().endswith(("yes", "NO"))]
    assert len(rows) == 3 and all(r.rstrip().endswith("yes") for r in rows), out.stdout
    assert "handshaken with the prefill ahead of the first request" in out.stdout
