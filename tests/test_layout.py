"""The serving side's rooms: the proxy loads no engine (and so no torch)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_the_proxy_loads_no_torch():
    """``kvbridge proxy`` (its CLI path and its app) must not import the engine: the
    request checks it shares with the engines live in kvbridge.server.schemas."""
    code = (
        "import sys\n"
        "from kvbridge.cli import main\n"
        "try:\n"
        "    main(['proxy', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "from kvbridge.server.proxy import build_proxy_app, run_proxy\n"
        "build_proxy_app(['http://127.0.0.1:1'], ['http://127.0.0.1:2'], prewarm=False,\n"
        "                admin_routes='open')\n"
        "import kvbridge.server.schemas, kvbridge.server.responses\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.',\n"
        "             'kvbridge.engine', 'kvbridge.model')))\n"
        "print('loaded:', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "usage: kvbridge proxy" in out.stdout and "loaded: []" in out.stdout
