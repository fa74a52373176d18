"""Figures for docs/security.md: what one endless answer costs the proxy, and one endless
watch line the registry client. Real sockets on loopback; prints one line per probe.

    PYTHONPATH=$PWD .venv/bin/python tests/endless_probe.py answer   # a `kvbridge proxy`
    PYTHONPATH=$PWD .venv/bin/python tests/endless_probe.py watch    # EtcdRegistry's watch

``answer``: a prefill answering 400 MiB of body (chunked, never JSON) to one request
through a `kvbridge proxy` process: its resident memory before, at its peak and after, the
status and how long the answer took, and how much the prefill got to send. ``watch``: a
gateway sending a 32 MiB line with no end, then closing: time to the ``RegistryError``,
CPU seconds and the peak of traced memory.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx

CHUNK = b"x" * 65536


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _head(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def answer() -> None:
    sent = [0]
    server = _listener()

    def prefill() -> None:
        while True:
            conn, _ = server.accept()
            _head(conn)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                while sent[0] < 400 << 20:
                    conn.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                    sent[0] += len(CHUNK)
                conn.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the proxy closed it

    threading.Thread(target=prefill, daemon=True).start()
    free = _listener()
    port = free.getsockname()[1]
    free.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", "proxy", "--prefill",
         f"http://127.0.0.1:{server.getsockname()[1]}", "--decode", "http://127.0.0.1:1",
         "--port", str(port), "--no-prewarm", "--timeout", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        before = _status_kib(proc.pid, "VmRSS")
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"},
                       timeout=120)
        took = time.monotonic() - t0
        print(f"answer: proxy RSS {before >> 10} MiB before, peak "
              f"{_status_kib(proc.pid, 'VmHWM') >> 10} MiB, after "
              f"{_status_kib(proc.pid, 'VmRSS') >> 10} MiB; {r.status_code} in {took:.2f} s; "
              f"the prefill sent {sent[0] >> 20} MiB: {r.text[:150]}")
    finally:
        proc.terminate()
        proc.wait()


def watch() -> None:
    from kvbridge.errors import RegistryError
    from kvbridge.registry.etcd_client import EtcdEndpoint, EtcdRegistry

    server = _listener()

    def gateway() -> None:
        conn, _ = server.accept()
        _head(conn)
        line = b'{"result":{"events":[{"kv":{"key":"'
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n" % (len(line), line))
            for _ in range(512):
                conn.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        conn.close()

    threading.Thread(target=gateway, daemon=True).start()
    registry = EtcdRegistry(EtcdEndpoint("127.0.0.1", server.getsockname()[1]))
    tracemalloc.start()
    t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_utime
    error = "none"
    try:
        for _ in registry.watch_prefix("/kvbridge/", 1, 65536):
            pass
    except RegistryError as e:
        error = str(e)[:100]
    print(f"watch: {time.monotonic() - t0:.2f} s, CPU "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_utime - cpu0:.2f} s, peak traced "
          f"{tracemalloc.get_traced_memory()[1] >> 20} MiB: {error}")


if __name__ == "__main__":
    {"answer": answer, "watch": watch}[sys.argv[1]]()
