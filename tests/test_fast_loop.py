"""`make test-fast` (pytest -m "not slow") leaves out real vLLM and the long end-to-end runs
(tests/conftest.py marks them by path), and keeps the rest."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, is_slow


def _fast(*paths: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", "not slow", *paths],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]  # 5: none left
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_real_vllm_and_long_end_to_end_runs_are_slow():
    # tests/vllm by path (collecting it imports vLLM, tens of seconds), every file there
    assert all(is_slow(p.relative_to(ROOT).as_posix(), "any")
               for p in (ROOT / "tests" / "vllm").rglob("test_*.py"))
    # the others as collected, marker and all
    kept = _fast("tests/e2e/test_demo.py", "tests/e2e/test_faults.py",
                 "tests/e2e/test_kv_lifecycle.py", "tests/test_install.py")
    assert not [n for n in kept if n.startswith(("tests/e2e/test_demo.py",
                                                 "tests/e2e/test_faults.py"))]
    assert any(n.startswith("tests/test_install.py::") for n in kept)
    lifecycle = [n for n in kept if n.startswith("tests/e2e/test_kv_lifecycle.py::")]
    assert lifecycle and not [n for n in lifecycle if "prefill_killed_mid_read" in n
                              or "slower_than_the_lease" in n]
