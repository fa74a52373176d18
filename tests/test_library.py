"""docs/library.md's example is the public API's test: run it exactly as written, in a
fresh interpreter (real NIXL agents, a real http side channel with a token)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_library_example_runs_as_documented():
    doc = (ROOT / "docs" / "library.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "read 2 READs; heads match" in out.stdout


def test_import_kvbridge_stays_light():
    out = subprocess.run([sys.executable, "-c", "import sys, kvbridge; "
                          "print('torch' in sys.modules, 'nixl' in sys.modules, "
                          "'nixl_cu12' in sys.modules)"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["False", "False", "False"], out.stderr
