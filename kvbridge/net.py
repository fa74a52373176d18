"""Binding listening ports (``listen_socket``: one helper for the side-channel servers): a
port in use is a configuration error that names its setting; picking a free port for a
child process to bind later; room in the fd table for a server's connections; a host as a
URL or a ``Host`` header writes it (``url_host``)."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import resource
import socket

from kvbridge.errors import ConfigError


def url_host(host: str) -> str:
    """``host`` as a URL or a ``Host`` header writes it: an IPv6 address in brackets
    (given with or without them)."""
    return f"[{host.strip('[]')}]" if ":" in host else host

def bind_error(host: str, port: int, setting: str, err: BaseException) -> ConfigError:
    """The one-line ``ConfigError`` for a failed bind of ``host:port`` (``setting`` names
    the flag / environment variable that chose the port)."""
    code = getattr(err, "errno", None)
    if code == errno.EADDRINUSE:
        return ConfigError(f"port {port} on {host} is already in use: choose another with "
                           f"{setting} (0 picks a free one)")
    if code == errno.EADDRNOTAVAIL:
        return ConfigError(f"cannot bind {host}:{port} ({setting}): {host} is not an "
                           "address of this machine")
    reason = getattr(err, "strerror", None) or str(err)
    return ConfigError(f"cannot bind {host}:{port} ({setting}): {reason}")


def bind_socket(host: str, port: int, setting: str) -> socket.socket:
    """A TCP socket bound to ``host:port``, not yet listening (so connections are refused
    until a server takes it over and listens)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve the host {host!r} to bind: {e.strerror}") from None
    # One socket: for a name with both families ("localhost") IPv4, which every client tries.
    families = [info[0] for info in infos]
    family = socket.AF_INET if socket.AF_INET in families else families[0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # As uvicorn and the side channel do: a port left in TIME_WAIT is not "in use".
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except (OSError, OverflowError) as e:  # OverflowError: a port beyond 65535
        sock.close()
        raise bind_error(host, port, setting, e) from None
    return sock


def listen_socket(host: str, port: int, setting: str, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for a server to take over: the
    port is known at once (0 picks a free one) and connections that arrive before the
    server runs wait in the backlog instead of being refused. ``IPPROTO_TCP`` rather than
    0: asyncio sets ``TCP_NODELAY`` only on sockets that say TCP (with Nagle on, every
    keep-alive reply waits ~40 ms for the peer's delayed ACK). A failure is the one-line
    ``ConfigError`` of ``bind_socket``."""
    sock = bind_socket(host, port, setting)
    try:
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise bind_error(host, port, setting, e) from None
    return sock


def check_port_free(host: str, port: int, setting: str) -> None:
    """Fail early, before anything slow starts, when ``host:port`` cannot be bound.

    The server binds again later and reports the same error if the port was taken
    meanwhile; this check only spares the user a long start-up before it.
    """
    if port != 0:
        bind_socket(host, port, setting).close()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral (outgoing source port) range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a server that binds it a little later.

    Chosen below the kernel's ephemeral range when there is room: a port from that range
    (what binding port 0 gives) can be taken as the source port of any outgoing
    connection before the server binds it; one below it only by another listener.
    """
    low = _ephemeral_low()
    candidates = random.sample(range(20000, low), k=min(64, max(0, low - 20000)))
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT is skipped too
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def grow_fd_table(connections: int) -> None:
    """Size this process's file-descriptor table for ``connections`` more sockets now,
    before a server accepts them (capped by the soft ``RLIMIT_NOFILE``).

    Why: the kernel grows the table by doubling when a new fd does not fit, and in a
    multi-threaded process each growth waits for an RCU grace period (``expand_fdtable``
    calls ``synchronize_rcu``), milliseconds during which ``accept`` blocks the event loop.
    A burst of 256 new connections to a fresh process grows the table 64 -> 512 in three
    such stalls, which a load generator that corrects for coordinated omission reports as
    a p99 of hundreds of milliseconds. Taking a high fd once,
    while starting, leaves a table that never grows under load.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = connections + 256  # the process's own fds (listeners, pipes, libraries)
    if soft != resource.RLIM_INFINITY:
        highest = min(highest, soft - 1)
    base = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # F_DUPFD takes the lowest free fd >= highest: never replaces an open one (dup2 would).
        os.close(fcntl.fcntl(base, fcntl.F_DUPFD_CLOEXEC, highest))
    except OSError:
        pass  # no room under the limit: the table grows on demand
    finally:
        os.close(base)
