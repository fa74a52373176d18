"""``kvbridge serve``'s side channel runs in a process of its own (a child of the serve
process): killed, it is restarted and counted while the instance keeps serving; the serve
process killed with SIGKILL, it is gone and its port free; stopped, the instance's /health
says so. Real processes, real TLS."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.handshake.process.parent import LIVENESS_TIMEOUT
from kvbridge.tools.testing.procfs import children, gone, listening
from kvbridge.tools.testing.wait import wait_until
from tests.e2e.conftest import START_TIMEOUT, Serve, complete

CHILD = "kvbridge.handshake.process.child"


@pytest.fixture
def prefill(certs: Path, tmp_path: Path) -> Iterator[Serve]:
    p = Serve("prefill-process", tmp_path, "--role", "prefill", "--handshake", "http",
              "--side-channel-port", "0", tls=certs)
    try:
        p.wait_ready(time.monotonic() + START_TIMEOUT)
        yield p
    finally:
        p.stop()


def _side(p: Serve, certs: Path) -> tuple[int, httpx.Client]:
    info = httpx.get(p.url + "/v1/kv/info", verify=p.verify, timeout=10).json()
    return info["side_channel_port"], httpx.Client(verify=p.verify, timeout=10)


def test_a_killed_side_channel_is_restarted_and_the_instance_keeps_serving(prefill, certs):
    (child,) = children(prefill.proc.pid, CHILD)
    port, c = _side(prefill, certs)
    with c:
        assert c.get(f"https://127.0.0.1:{port}/readyz").text == "ready"
        os.kill(child, signal.SIGKILL)
        restarted = wait_until(lambda: [p for p in children(prefill.proc.pid, CHILD)
                                        if p != child], 30, "a new side-channel process")
        assert restarted and gone(child)
        wait_until(lambda: c.get(f"https://127.0.0.1:{port}/readyz").text == "ready", 30,
                   "the new side channel ready", tolerate=(httpx.TransportError,))
        assert prefill.metric(
            'kvbridge_background_thread_restarts_total{thread="kvbridge-side-channel"}') == 1
        assert c.get(prefill.url + "/health").status_code == 200
    assert f"side-channel process {child} exited with signal 9" in prefill.log.read_text()
    assert complete(prefill.url, "still serving", verify=prefill.verify)


def test_the_serve_process_killed_leaves_no_side_channel_and_no_port(prefill, certs):
    (child,) = children(prefill.proc.pid, CHILD)
    port, _ = _side(prefill, certs)
    prefill.proc.kill()
    prefill.proc.wait()
    wait_until(lambda: gone(child), 30, "the side-channel process gone with serve")
    assert not listening(port)


def test_the_instances_health_follows_a_stopped_side_channel(prefill, certs):
    """The instance pings its side-channel process over the control socket: stopped
    (SIGSTOP), it is down in /health (503 naming it) within the liveness timeout; resumed,
    /health is 200 again, the same process serving."""
    (child,) = children(prefill.proc.pid, CHILD)
    port, c = _side(prefill, certs)
    with c:
        assert c.get(prefill.url + "/health").status_code == 200
        os.kill(child, signal.SIGSTOP)
        try:
            r = wait_until(lambda: (h := c.get(prefill.url + "/health")).status_code != 200
                           and h, LIVENESS_TIMEOUT + 15, "/health down")
            assert r.status_code == 503
            assert f"side-channel process {child} not answering" in \
                r.json()["background_down"]["kvbridge-side-channel"]
        finally:
            os.kill(child, signal.SIGCONT)
        wait_until(lambda: c.get(prefill.url + "/health").status_code == 200, 15,
                   "/health up again")
        assert children(prefill.proc.pid, CHILD) == [child]
        assert c.get(f"https://127.0.0.1:{port}/readyz").text == "ready"
