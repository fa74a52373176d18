"""What the side-channel process (``kvbridge.handshake.process.child``) and its parent
(``kvbridge.handshake.process.parent``) say to each other, over a private socketpair.

A message is a 4-byte big-endian length and a pickled tuple whose first item names it.
Pickle is safe here: the socketpair is created by the parent and inherited by the child
it execs; nothing from the network reaches it.

Parent to child:
  ``("start", ServerSpec)``  once, first: what to serve and how;
  ``("payloads", {(pp, tp): bytes}, {(pp, tp): description}, n)``  republish number n;
  ``("health", str | None)``  why the instance cannot serve KV now (None: it can);
  ``("ping", n)``  liveness: answered ``("pong", n)`` from the loop that serves;
  ``("stop",)``  stop serving and exit (end of file means the same).
Child to parent:
  ``("ready", port)`` or ``("error", exception type name, message)``, once, after "start";
  ``("observed", {(route, status): (requests, body bytes)}, {server: guard figures})``
  what was answered lately, and the connection guards (``kvbridge.guard.guard_stats``);
  ``("republished", n)``  republish n is served (and put in etcd, for that method);
  ``("pong", n)``  ping n reached the serving loop (``HandshakeServer.when_responsive``).
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from kvbridge.config import SideChannelConfig
from kvbridge.handshake.base import MetadataStore
from kvbridge.handshake.factory import Wire

_LEN = struct.Struct(">I")


@dataclass
class ServerSpec:
    """What the child builds: the server ``kvbridge.handshake.factory.make_server`` makes
    for ``config`` and ``store``; ``wire``: what the ``zmq`` method speaks (``make_server``'s
    ``wire``); ``observe``: report requests."""

    config: SideChannelConfig
    store: MetadataStore
    wire: Wire = "kvbridge"
    observe: bool = False
    health: str | None = None


class Channel:
    """One end of the socketpair. ``send`` may be called from any thread; ``recv`` from
    one thread only."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, *message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(_LEN.pack(len(data)) + data)

    def recv(self) -> tuple[Any, ...] | None:
        """The next message; None at end of file (the other end closed or died). A
        timeout set on the socket raises ``TimeoutError`` only between messages."""
        head = self._read(_LEN.size, first=True)
        if head is None:
            return None
        body = self._read(_LEN.unpack(head)[0])
        return None if body is None else pickle.loads(body)

    def _read(self, n: int, first: bool = False) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except TimeoutError:
                if first and not buf:
                    raise
                continue  # inside a message: the rest is on its way
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()
