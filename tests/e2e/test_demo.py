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
    # exit 0 only if the prewarm succeeded and every answer was read from the prefill's KV
    # (no recompute) and equals the decode's own computation
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FAILED" not in out.stderr, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines()
            if line.rstrip().endswith(("yes", "NO"))]
    assert len(rows) == 3 and all(r[-2:] == ["yes", "yes"] for r in rows), out.stdout
    assert all(float(r[3]) > 0 for r in rows), out.stdout  # KiB of KV moved
    assert "handshaken with the prefill ahead of the first request" in out.stdout
