"""``VllmZmqClient`` (vLLM 0.32's zmq handshake, client side) against hostile peers on
loopback, no vLLM needed: a reply is bounded in frames and bytes as it arrives, whatever
the peer keeps sending, and the client's memory stays flat."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time

import pytest

from kvbridge.errors import WireFormatError
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient, VllmZmqServer
from tests import zmtp_raw
from tests.helpers import wait_until

HOST = "127.0.0.1"
FRAME = 16 * 1024
TIMEOUT = 5.0
# The client in a process of its own, so its RSS is its own: before and after one fetch.
_CLIENT = """
import json, sys, time
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

port, timeout = int(sys.argv[1]), float(sys.argv[2])
before = status("VmRSS")
t0 = time.monotonic()
try:
    VllmZmqClient(timeout, 1 << 20).fetch_ranks("127.0.0.1", port, [(0, 0)])
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"error": error, "seconds": time.monotonic() - t0, "before": before,
                  "after": status("VmRSS"), "peak": status("VmHWM")}))
"""


def test_endless_multi_frame_reply_is_refused_at_the_limit_and_rss_stays_flat():
    """Issue 25 item 4: 16 KiB frames, each under libzmq's MAXMSGSIZE, never ending (up to
    320 MiB): refused at the frame limit, within the timeout, the client's RSS flat."""
    sent: list[int] = []
    with zmtp_raw.streaming_router(zmtp_raw.frame(b"\x00" * FRAME, more=True), sent, 20_000) as srv:
        out = subprocess.run([sys.executable, "-c", _CLIENT, str(srv.port), str(TIMEOUT)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        wait_until(lambda: sent, 10, "the server to see the client go")
    assert got["error"] is not None and got["error"].startswith("WireFormatError: "), got
    assert f"zmq://{HOST}:{srv.port}: reply of more than the limit of 3 frames" in got["error"]
    assert got["seconds"] < TIMEOUT
    # Flat: the peak over the fetch (read frames included) within a few MiB of the start.
    assert got["peak"] - got["before"] < 4, got
    assert got["after"] - got["before"] < 4, got
    assert sent[0] < 20_000  # the client let go at the limit, not at the end


def test_reply_bytes_are_capped_at_max_message_bytes():
    """A payload of ``max_message_bytes`` is read; one byte more is refused before it is
    read, with an error naming the setting (not a timeout)."""
    limit = 100_000
    server = VllmZmqServer({(0, 0): b"p" * limit, (0, 1): b"p" * (limit + 1)}, HOST, 0)
    server.start()
    try:
        client = VllmZmqClient(10.0, limit)
        assert client.fetch_ranks(HOST, server.port, [(0, 0)]).payloads == {(0, 0): b"p" * limit}
        t0 = time.monotonic()
        with pytest.raises(WireFormatError, match=f"a payload of {limit + 1} bytes, over the "
                                                  f"limit of max_message_bytes {limit}"):
            client.fetch_ranks(HOST, server.port, [(0, 0), (0, 1)])
        assert time.monotonic() - t0 < 10.0
    finally:
        server.stop()
    # A frame that declares 2**40 bytes: refused from its head, nothing of it read.
    sent: list[int] = []
    declared = zmtp_raw.frame(b"", more=True) + bytes([0x03]) + struct.pack(">Q", 2**40)
    with zmtp_raw.streaming_router(declared, sent, 1) as srv:
        with pytest.raises(WireFormatError, match=rf"reply over the limit of {limit + 16} bytes "
                                                  rf"\(max_message_bytes {limit} \+ 16 for the "
                                                  r"clock frame\)"):
            VllmZmqClient(10.0, limit).fetch_ranks(HOST, srv.port, [(0, 0)])
