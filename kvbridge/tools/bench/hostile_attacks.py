"""``kvbridge bench hostile``'s attacks: floods of the side channel (idle, mutual TLS,
slowloris), the endless zmq message, and the pinning flood through the proxy. Each
returns what it measured: real handshakes during the attack, connections the server
holds, the attacked instance's resident memory (``instance_rss_mib``)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvbridge.tools.bench.common import progress
from kvbridge.tools.bench.report import percentiles
from kvbridge.tools.launch import read_metric
from kvbridge.tools.testing.procfs import instance_rss_mib
from kvbridge.tools.testing.wait import WaitTimeout, wait_until

HOST = "127.0.0.1"


def _held(port: int) -> int:
    """Connections the server on ``port`` holds open (its ESTABLISHED sockets)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                n += 1
    return n


def _timed(fetch: Callable[[], object], n: int) -> tuple[list[float], int]:
    """Seconds per handshake, and how many failed."""
    times, failed = [], 0
    for _ in range(n):
        start = time.monotonic()
        try:
            fetch()
            times.append(time.monotonic() - start)
        except Exception:  # a refused handshake is the figure we report
            failed += 1
    return times, failed


def _settled_rss_mib(pid: int, seconds: float = 3.0) -> float:
    """RSS ``seconds`` after the attack ended (the server trims its heap a second after
    a burst of closed connections)."""
    time.sleep(seconds)
    return instance_rss_mib(pid)


def side_channel_attack(
    name: str,
    pid: int,
    port: int,
    open_conns: Callable[[], list[socket.socket]],
    fetch: Callable[[], object],
    n_handshakes: int,
) -> dict[str, Any]:
    progress(f"hostile: {name}")
    before = instance_rss_mib(pid)
    t0 = time.monotonic()
    socks = open_conns()
    opened = time.monotonic() - t0
    peak = instance_rss_mib(pid)
    times, failed = _timed(fetch, n_handshakes)
    held = _held(port)
    peak = max(peak, instance_rss_mib(pid))
    for s in socks:
        s.close()
    after = _settled_rss_mib(pid)
    return {
        "connections": len(socks),
        "open_seconds": round(opened, 3),
        "held_after_handshakes": held,
        "handshakes": n_handshakes,
        "handshakes_failed": failed,
        "handshake_ms": percentiles(times),
        "handshake_max_ms": 1000 * max(times) if times else float("nan"),
        "rss_mib": {"before": before, "peak": peak, "after": after},
    }


def zmq_endless(
    pid: int, port: int, frames: int, fetch: Callable[[], object], n_handshakes: int
) -> dict[str, Any]:
    progress("hostile: zmq_endless")
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    ready_body = b"\x05READY\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    chunk = b"\x03" + (16 * 1024).to_bytes(8, "big") + b"\x00" * 16 * 1024  # MORE | LONG
    before = peak = instance_rss_mib(pid)
    sent, stop = 0, "not dropped"
    with socket.create_connection((HOST, port), timeout=30) as s:
        s.sendall(greeting + bytes([0x04, len(ready_body)]) + ready_body)
        for sent in range(1, frames + 1):
            try:
                s.sendall(chunk)
            except OSError as e:
                stop = f"{type(e).__name__}: {e}"
                break
            if sent % 1000 == 0:
                peak = max(peak, instance_rss_mib(pid))
    peak = max(peak, instance_rss_mib(pid))
    after = _settled_rss_mib(pid)
    times, failed = _timed(fetch, n_handshakes)
    return {
        "frames_tried": frames,
        "frames_sent_before_drop": sent,
        "dropped": sent < frames,
        "stop": stop,
        "handshake_ms": percentiles(times),
        "handshakes_failed": failed,
        "rss_mib": {"before": before, "peak": peak, "after": after},
    }


PINNING_PROMPT = "A long prompt fills many blocks of the prefill's KV cache, on purpose. " * 14


def pinning_flood(proxy: str, prefill: str, n: int) -> dict[str, Any]:
    """``n`` requests with a 300-character request id through the proxy, one after the
    other; then the prefill's free blocks, and a legitimate request's latency."""
    body = {"model": "kvbridge-tiny", "prompt": PINNING_PROMPT, "max_tokens": 2,
            "temperature": 0}
    with httpx.Client(timeout=120, trust_env=False) as c:
        def free() -> float:
            return read_metric(c, prefill, "kvbridge_blocks_free")

        def legit() -> float:
            t0 = time.monotonic()
            r = c.post(proxy + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return time.monotonic() - t0

        legit_before = min(legit() for _ in range(3))  # the first one pays the handshake
        with contextlib.suppress(WaitTimeout):  # their READs' releases (measured anyway)
            wait_until(lambda: not read_metric(c, prefill, "kvbridge_held_requests"), 40,
                       "held requests released", every=0.05)
        before = free()
        statuses = []
        for i in range(n):
            r = c.post(proxy + "/v1/completions", json=body,
                       headers={"x-request-id": f"{i:04d}" * 75})
            statuses.append(str(r.status_code))
        after = free()
        t0 = time.monotonic()
        legit_after = legit()  # right after the flood, whatever it left held
        with contextlib.suppress(WaitTimeout):  # the lease is 30 s; the figure says how long
            wait_until(lambda: free() >= before, 40, "blocks back", every=0.05)
        back = time.monotonic() - t0
        non_ascii = c.post(proxy + "/v1/completions", json=body,
                           headers={"x-request-id": "r\u00e9q".encode()}).status_code
    return {"requests": n, "free_blocks_before": before, "free_blocks_after_flood": after,
            "blocks_back_s": back, "statuses": sorted(set(statuses)),
            "legit_request_s": {"before": legit_before, "after": legit_after},
            "non_ascii_id_status": non_ascii}
