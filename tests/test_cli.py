"""``kvbridge`` refuses unsafe or inconsistent settings at start-up, with a clear message
and exit status 2, before starting anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _kvbridge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbridge.cli", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture
def loose_token(tmp_path):
    p = tmp_path / "token"
    p.write_text("t0ken")
    p.chmod(0o644)
    return p


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--side-channel-host", "0.0.0.0"], {}, "wildcard"),
    (["--side-channel-host", "::"], {}, "wildcard"),
    ([], {"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0"}, "wildcard"),
    (["--ssl-keyfile", "/nonexistent/key.pem"], {}, "without a certificate"),
    (["--handshake-timeout", "0"], {}, "handshake timeout"),
    ([], {"KVBRIDGE_HANDSHAKE_METHOD": "smoke-signals"}, "handshake method"),
    (["--side-channel-ssl-keyfile", "/x/k.pem"], {}, "needs --side-channel-ssl-certfile"),
])
def test_serve_refuses_unsafe_settings(args, env, message):
    out = _kvbridge("serve", "--role", "prefill", *args, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "configuration error" in out.stderr and message in out.stderr


def test_serve_refuses_a_token_file_readable_by_others(loose_token):
    out = _kvbridge("serve", "--side-channel-token-file", str(loose_token))
    assert out.returncode == 2
    assert "readable by group or others" in out.stderr and "chmod 600" in out.stderr


def test_proxy_refuses_a_token_file_readable_by_others(loose_token):
    out = _kvbridge("proxy", "--prefill", "http://127.0.0.1:1", "--decode",
                    "http://127.0.0.1:2", "--kv-token-file", str(loose_token))
    assert out.returncode == 2 and "chmod 600" in out.stderr

