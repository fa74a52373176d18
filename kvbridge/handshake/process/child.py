"""The side-channel process: ``python -m kvbridge.handshake.process.child``, started by
``kvbridge.handshake.process.parent.SideChannelProcess`` (never by hand).

It builds the server its parent describes (``kvbridge.handshake.process.control.ServerSpec``) on
the listening socket it inherits, answers, and reports what it answered. It stops
gracefully when told to, when its control socket ends, or on SIGTERM. It never outlives
its parent (``PR_SET_PDEATHSIG``): a child that listens is killed with it (SIGKILL), so its
port is free the moment it is reaped, with no Python left to run. A graceful stop there
would serve a dead instance's metadata for a while (up to a second of draining TLS
keep-alive peers), long enough for the instance restarted on the same ports to find the
port still taken. An etcd child, which has no port, gets SIGTERM instead and revokes its
record on the way out.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections import Counter

from kvbridge.guard import guard_stats
from kvbridge.handshake.factory import make_server
from kvbridge.handshake.process.control import Channel, ServerSpec

log = logging.getLogger("kvbridge.side-channel")

PR_SET_PDEATHSIG = 1
FLUSH_SECONDS = 0.25  # how often what was answered (and the guards) go back to the parent
EXIT_DEADLINE = 5.0  # a stop that takes longer ends the process anyway


class _Stop(Exception):
    """SIGTERM: stop serving."""


def _die_with_parent(parent: int, listens: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    sig = signal.SIGKILL if listens else signal.SIGTERM  # see the module's docstring
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        log.warning("PR_SET_PDEATHSIG failed (errno %d): relying on the control socket",
                    ctypes.get_errno())
    if os.getppid() != parent:  # it died before the line above: nobody is left to serve
        sys.exit(0)


class _Observed:
    """Requests answered since the last flush, by (route, status): (count, body bytes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, int]] = Counter()
        self._bytes: Counter[tuple[str, int]] = Counter()

    def __call__(self, route: str, status: int, nbytes: int) -> None:
        with self._lock:
            self._counts[route, status] += 1
            self._bytes[route, status] += nbytes

    def take(self) -> dict[tuple[str, int], tuple[int, int]]:
        with self._lock:
            counts, self._counts = self._counts, Counter()
            sizes, self._bytes = self._bytes, Counter()
        return {k: (n, sizes[k]) for k, n in counts.items()}


def serve(channel: Channel, listen_fd: int | None) -> int:
    message = channel.recv()
    if message is None or message[0] != "start":
        return 0  # the parent went away before saying what to serve
    spec: ServerSpec = message[1]
    store = spec.store
    health = spec.health
    store.health = lambda: health
    observed = _Observed() if spec.observe else None
    try:
        sock = None if listen_fd is None else socket.socket(fileno=listen_fd)
        server = make_server(spec.config, store, observer=observed, wire=spec.wire, sock=sock)
        server.start()
    except Exception as e:
        channel.send("error", type(e).__name__, str(e))
        return 1
    channel.send("ready", server.port)
    gc.freeze()  # what start-up built lives as long as the process: no collection scans it
    stop = threading.Event()
    threading.Thread(target=_report, args=(channel, observed, stop), daemon=True,
                     name="kvbridge-side-channel-report").start()
    try:
        while (message := channel.recv()) is not None and message[0] != "stop":
            if message[0] == "health":
                health = message[1]
            elif message[0] == "ping":  # answered once the serving loop gets to it
                server.when_responsive(lambda n=message[1]: _pong(channel, n))
            elif message[0] == "payloads":
                store.set_payloads(message[1], message[2])  # type: ignore[attr-defined]
                server.payloads_changed(message[1])
                channel.send("republished", message[3])
    except (_Stop, OSError):
        pass
    finally:
        stop.set()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already (a second word)
        # never linger: a stop that hangs (a peer that never closes) ends with the process
        deadline = threading.Timer(EXIT_DEADLINE, os._exit, args=(0,))
        deadline.daemon = True
        deadline.start()
        server.stop()
    return 0


def _pong(channel: Channel, n: int) -> None:
    try:
        channel.send("pong", n)
    except OSError:
        pass  # the parent is gone: the control loop ends too


def _report(channel: Channel, observed: _Observed | None, stop: threading.Event) -> None:
    """What was answered, and the connection guards' figures, to the parent when they
    change (its metrics show them)."""
    last: dict[str, tuple[int, int, int, int]] = {}
    while not stop.wait(FLUSH_SECONDS):
        counts = {} if observed is None else observed.take()
        guards = guard_stats()
        if counts or guards != last:
            last = guards
            try:
                channel.send("observed", counts, guards)
            except OSError:
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.handshake.process.child",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--listen-fd", type=int)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)

    def _term(signum: int, frame: object) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the parent, which stops us
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s kvbridge side-channel[%(process)d] "
                               "%(levelname)s %(message)s")
    _die_with_parent(args.parent, listens=args.listen_fd is not None)
    channel = Channel(socket.socket(fileno=args.control_fd))
    try:
        return serve(channel, args.listen_fd)
    except _Stop:
        return 0


if __name__ == "__main__":
    sys.exit(main())
