"""``kvbridge`` refuses unsafe or inconsistent settings at start-up, with a clear message
and exit status 2, before starting anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvbridge.net import free_port
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
    (["--handshake-timeout", "0"], {}, "--handshake-timeout='0'"),
    ([], {"KVBRIDGE_HANDSHAKE_METHOD": "smoke-signals"},
     "KVBRIDGE_HANDSHAKE_METHOD='smoke-signals'"),
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



def _one_line_exit_2(out: subprocess.CompletedProcess, *needles: str) -> str:
    """A user mistake: exit 2, exactly one line on stderr naming it, no traceback."""
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port():
    """A loopback port another process (here: this one) is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("method", ["zmq", "http"])
def test_serve_side_channel_port_in_use(busy_port, method):
    out = _kvbridge("serve", "--role", "prefill", "--handshake", method,
                    "--side-channel-port", str(busy_port))
    _one_line_exit_2(out, f"port {busy_port}", "already in use", "--side-channel-port",
                     "KVBRIDGE_SIDE_CHANNEL_PORT")


def test_serve_side_channel_port_in_use_from_the_environment(busy_port):
    out = _kvbridge("serve", "--role", "both", env={"KVBRIDGE_SIDE_CHANNEL_PORT": str(busy_port)})
    _one_line_exit_2(out, f"port {busy_port}", "already in use", "KVBRIDGE_SIDE_CHANNEL_PORT")


def test_serve_api_port_in_use(busy_port):
    out = _kvbridge("serve", "--role", "decode", "--port", str(busy_port))
    _one_line_exit_2(out, f"port {busy_port}", "already in use", "--port")


def test_proxy_port_in_use(busy_port):
    out = _kvbridge("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--port", str(busy_port))
    _one_line_exit_2(out, f"port {busy_port}", "already in use", "--port")


@pytest.mark.parametrize(("args", "needle"), [
    (["--tp", "0"], "--tp"),
    (["--num-blocks", "0"], "--num-blocks"),
    (["--num-blocks", "-4"], "--num-blocks"),
    (["--block-size", "0"], "--block-size"),
    (["--kv-lease-seconds", "-1"], "--kv-lease-seconds"),
    (["--transfer-timeout", "0"], "--transfer-timeout"),
    (["--transfer-timeout", "nan"], "--transfer-timeout"),
    (["--handshake-timeout", "-3"], "--handshake-timeout"),
    (["--kv-peer", "127.0.0.1"], "--kv-peer"),
    (["--port", "70000"], "--port"),
])
def test_serve_refuses_impossible_sizes(args, needle):
    out = _kvbridge("serve", "--role", "both", "--side-channel-port", "0", *args)
    _one_line_exit_2(out, "configuration error", needle)


def test_proxy_refuses_a_negative_timeout():
    out = _kvbridge("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                    "--timeout", "-1")
    _one_line_exit_2(out, "--timeout")


def test_serve_refuses_a_bad_progress_delay():
    out = _kvbridge("serve", "--side-channel-port", "0", "--port", "0",
                    env={"KVBRIDGE_NIXL_PROGRESS_DELAY_US": "fast"})
    _one_line_exit_2(out, "KVBRIDGE_NIXL_PROGRESS_DELAY_US")


@pytest.mark.parametrize(("command", "args", "env", "message"), [
    ("serve", ["--max-connections", "0"], {}, "--max-connections='0'"),
    ("serve", [], {"KVBRIDGE_HEAD_TIMEOUT": "soon"}, "KVBRIDGE_HEAD_TIMEOUT"),
    ("proxy", ["--prefill", "http://a:1", "--decode", "http://b:2", "--first-byte-timeout",
               "-1"], {}, "--first-byte-timeout='-1'"),
    ("proxy", ["--prefill", "http://a:1", "--decode", "http://b:2", "--prefill-timeout",
               "0"], {}, "--prefill-timeout"),
    ("proxy", ["--prefill", "http://a:1", "--decode", "http://b:2", "--port", "0",
               "--admin-routes", "token"], {}, "needs an admin token"),
    ("proxy", ["--prefill", "http://a:1", "--decode", "http://b:2", "--port", "0"],
     {"KVBRIDGE_METRICS_ROUTE": "public"}, "KVBRIDGE_METRICS_ROUTE='public'"),
])
def test_connection_budgets_are_checked_at_start_up(command, args, env, message):
    out = _kvbridge(command, *args, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "configuration error" in out.stderr and message in out.stderr


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    """A port picked for a child to bind later is one no outgoing connection can take."""
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = {free_port() for _ in range(20)}
    for port in ports:
        if low > 20000:
            assert not low <= port <= high, (port, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed
