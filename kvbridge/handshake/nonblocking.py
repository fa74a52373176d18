"""Reads and writes on the side-channel client's non-blocking sockets, a reply that is not
there yet waited for by spinning briefly before sleeping.

Why spin: a warm fetch on loopback is answered in about 25 us, and a thread that sleeps
in ``poll`` until then pays the wake-up of another core on top (15-20 us on a VM, most of
what was left between the plug-in's warm fetch and stock vLLM's; BENCHMARKS.md, section
11f). Up to ``SPIN_S`` the reader retries, yielding its core at each turn: a server on the
same core runs at once, and on an idle core the yield returns at once. A farther peer is
waited for in ``select``, as before.

A socket in blocking or timeout mode works too: its reads and writes never raise
``BlockingIOError``, so none of this applies.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time

__all__ = ["SPIN_S", "recv_some", "send_all"]

SPIN_S = 200e-6  # how long a reply is waited for awake, before sleeping in select
RECV_BYTES = 65536
_NOT_YET = (BlockingIOError, ssl.SSLWantReadError)


def recv_some(sock: socket.socket, wait: float | None) -> bytes:
    """What the peer sent next (b"" at end of file). ``wait``: the longest sleep for a
    byte to come, after the spin (None: no bound); past it, ``TimeoutError``."""
    try:
        return sock.recv(RECV_BYTES)
    except _NOT_YET:
        pass
    until = time.perf_counter() + SPIN_S
    while time.perf_counter() < until:
        os.sched_yield()
        try:
            return sock.recv(RECV_BYTES)
        except _NOT_YET:
            pass
    while True:
        _wait_for(sock, wait)
        try:
            return sock.recv(RECV_BYTES)
        except _NOT_YET:  # a TLS record not yet whole: wait for the rest
            pass
        except ssl.SSLWantWriteError:  # TLS wants to write first (a key update)
            _wait_for(sock, wait, write=True)


def send_all(sock: socket.socket, data: bytes, wait: float | None) -> None:
    """Send all of ``data``, sleeping in select while the socket cannot take more."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except (BlockingIOError, ssl.SSLWantWriteError):
            _wait_for(sock, wait, write=True)
            continue
        except ssl.SSLWantReadError:  # TLS wants to read first
            _wait_for(sock, wait)
            continue
        view = view[sent:]


def _wait_for(sock: socket.socket, wait: float | None, write: bool = False) -> None:
    ready = select.select([], [sock], [], wait)[1] if write else \
        select.select([sock], [], [], wait)[0]
    if not ready:
        raise TimeoutError("timed out")
