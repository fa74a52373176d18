"""``make demo``'s command, as a user runs it: three processes over TLS with a token, and
every answer equal to the decode's own computation without transferred KV. By default on
the real SmolLM2 (a wrong transfer would show as a wrong answer); ``--model tiny`` keeps
the built-in random-weight model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.real_model import CAPITAL_ANSWER, smollm2_dir

# Two engines of a real model on a small, shared machine: minutes, not seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _demo(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "kvbridge.cli", "demo", *args],
                         capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
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
    return out


def test_demo_answers_real_questions_through_pd():
    smollm2_dir()  # prepared (or skipped) here, so the demo's own run finds it ready
    out = _demo("--max-tokens", "12")
    assert f"-> {CAPITAL_ANSWER!r}" in out.stdout, out.stdout
    assert "model smollm2-135m-instruct, prefill TP 1 -> decode TP 1" in out.stdout
    # 30 layers x (K, V) x 3 KV heads x 64 x 4 bytes x 16 tokens a block, whole blocks
    block_kib = 30 * 2 * 3 * 64 * 4 * 16 / 1024
    rows = [line.split() for line in out.stdout.splitlines()
            if line.rstrip().endswith(("yes", "NO"))]
    assert all(float(r[3]) % block_kib == 0 for r in rows), out.stdout


def test_demo_on_the_tiny_model():
    out = _demo("--model", "tiny", "--max-tokens", "8")
    assert "model kvbridge-tiny, prefill TP 1 -> decode TP 2" in out.stdout
