"""The side channel in a process of its own: ``SideChannelProcess`` starts
``python -m kvbridge.handshake.process.child``, hands it what to serve, and keeps it running.

Why a process: a server that shares its interpreter with an engine answers when the
engine lets it (vLLM's engine core holds the GIL nearly all the time), and a crash or a GC
pause of one is felt by the other.

* The listening socket is bound here and inherited by the child: the port is known, and a
  bind error reported, before the child runs; connections that arrive while a child
  restarts wait in the backlog.
* The child never outlives this process, however it dies (SIGKILL included): the kernel
  kills it when the thread that started it ends (``PR_SET_PDEATHSIG``; that thread is the
  supervisor's, which lives until ``stop``): with SIGKILL, so the port is free for an
  instance restarted at once on the same ports (an etcd child, with no port, gets SIGTERM
  and revokes its record). Should that fail, its control socket reaches end of file and
  it stops by itself.
* A child that dies is restarted with backoff by ``kvbridge.supervised.Supervised``; while
  it waits, while a child starts, and while a serving child's loop answers no liveness
  ping over the control socket for ``LIVENESS_TIMEOUT`` (stopped, hung, flooded; pinged
  every ``PING_INTERVAL`` when there is a health to follow), ``problem`` says why,
  ``/health`` of the instance answers 503 naming it, and
  ``kvbridge_background_thread_up{thread="kvbridge-side-channel"}`` is 0. Requests that
  need no new handshake never touch it.
* The store's payloads go to the child at start, and again on every ``payloads_changed``;
  the instance's health (``health``) is sent whenever it changes. What the child answered
  comes back to ``observer`` (metrics) every quarter second, and its connection guards'
  figures to ``GuardMirror``s here (``kvbridge_connections``, ``..._closed_total``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from kvbridge import errors
from kvbridge.config import SIDE_CHANNEL_PORT_SETTING, SideChannelConfig
from kvbridge.errors import SideChannelError
from kvbridge.guard import GuardMirror
from kvbridge.handshake.base import HandshakeServer, MetadataStore, Observer
from kvbridge.handshake.factory import Wire, make_server
from kvbridge.handshake.process.control import Channel, ServerSpec
from kvbridge.net import listen_socket
from kvbridge.supervised import Supervised

__all__ = ["SideChannelProcess", "side_channel"]

log = logging.getLogger(__name__)

REPUBLISH_TIMEOUT = 10.0  # a republish the child has not confirmed by then is logged
HEALTH_POLL = 0.1  # how often the instance's health is looked at (forwarded on change)
PING_INTERVAL = 0.5  # how often the child's serving loop is pinged (with a health only)
LIVENESS_TIMEOUT = 5.0  # a child whose loop answered no ping for this long is down


def side_channel(config: SideChannelConfig, store: MetadataStore, port: int | None = None,
                 observer: Observer | None = None, *, wire: Wire = "kvbridge",
                 health: Callable[[], str | None] | None = None) -> HandshakeServer:
    """The side-channel server an instance starts (not started): in a process of its own
    unless ``config.side_channel_isolation`` is ``thread``. ``health``: why the instance
    cannot serve KV now (None: it can); the side channel answers 503 meanwhile.
    ``serve`` and the vLLM plug-in both start theirs here."""
    if config.side_channel_isolation == "process":
        return SideChannelProcess(config, store, port, observer, wire=wire, health=health)
    store.health = health
    return make_server(config, store, port, observer, wire=wire)


class SideChannelProcess(HandshakeServer):
    """A ``HandshakeServer`` whose server runs in a child process (see the module)."""

    def __init__(self, config: SideChannelConfig, store: MetadataStore, port: int | None = None,
                 observer: Observer | None = None, *, wire: Wire = "kvbridge",
                 health: Callable[[], str | None] | None = None, start_timeout: float = 60.0):
        self.method = config.handshake_method
        self.store = store
        self._spec = ServerSpec(config, store, wire, observe=observer is not None)
        self._observer = observer
        self._health = health
        self._start_timeout = start_timeout
        port = config.side_channel_port if port is None else port
        # etcd has no socket: the port only names the record (the child picks one for 0)
        self._sock = None if self.method == "etcd" else listen_socket(
            config.side_channel_host, port, SIDE_CHANNEL_PORT_SETTING)
        self._port = port if self._sock is None else self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._channel: Channel | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._up = False
        self._health_sent: str | None = None  # what the child was told last
        # its connection guards, in this process's metrics (kvbridge_connections...)
        self._guards: dict[str, GuardMirror] = {}
        self._acks = threading.Condition()  # republishes sent, and served by the child
        self._republishes = 0
        self._acked = 0
        self._why_not_up = "starting"  # while no child serves: what it is doing
        self._last_pong = 0.0  # when the child's loop last answered a ping (monotonic)
        self._thread = Supervised("kvbridge-side-channel", self._loop, self._stop,
                                  liveness=self._liveness)

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int | None:
        """The running child's process id (None between children)."""
        proc = self._proc
        return None if proc is None or proc.poll() is not None else proc.pid

    @property
    def problem(self) -> str | None:
        """Why no child serves now (None: one does)."""
        if self._thread.down_reason is not None:
            return self._thread.down_reason
        return None if self._up else self._why_not_up

    def _liveness(self) -> str | None:
        """Why the side channel is down while its supervisor runs: a child starting (or
        just ended), or one whose serving loop has not answered a ping for
        ``LIVENESS_TIMEOUT`` (stopped, hung, flooded). Pings go only with a health to
        follow (an instance's: its /health says so); without one (the vLLM plug-in) the
        supervisor never wakes for them."""
        if not self._up:
            return self._why_not_up
        if self._health is None:
            return None
        silent = time.monotonic() - self._last_pong
        if silent > LIVENESS_TIMEOUT:
            return f"side-channel process {self.pid} not answering for {silent:.0f}s"
        return None

    @property
    def restarts(self) -> int:
        return self._thread.restarts

    @property
    def running(self) -> bool:
        return self.problem is None

    def start(self) -> None:
        """Start the child and wait until it serves; its start-up error is raised here."""
        self._thread.start()
        if not self._ready.wait(self._start_timeout):
            self.stop()
            raise SideChannelError(f"the side-channel process did not start within "
                                   f"{self._start_timeout:g}s")
        if self._start_error is not None:
            self.stop()
            raise self._start_error

    def payloads_changed(self, payloads: dict[tuple[int, int], bytes]) -> None:
        """The store already holds ``payloads``: send them (and their JSON views), and
        return once the child serves them (an etcd record put again included), as a
        server in this process would; a child that is down starts from the store."""
        held = getattr(self.store, "payloads", None)
        described = {} if held is None else held()[1]
        with self._acks:
            self._republishes += 1
            seq = self._republishes
        self._send("payloads", payloads, {r: described[r] for r in payloads if r in described},
                   seq)
        with self._acks:
            if not self._acks.wait_for(lambda: self._acked >= seq or not self._up,
                                       timeout=REPUBLISH_TIMEOUT):
                log.warning("kvbridge side channel: republish %d not confirmed within %gs",
                            seq, REPUBLISH_TIMEOUT)

    def health_changed(self) -> None:
        """Send the instance's health now rather than at the next poll (the instance calls
        it when it becomes ready, so that ``/readyz`` follows at once)."""
        health = self._health_now()
        self._health_sent = health
        self._send("health", health)

    def stop(self) -> None:
        self._stop.set()
        self._send("stop")
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("side-channel process %d did not stop: killed", proc.pid)
                proc.kill()
                proc.wait()
        self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()

    # -- the supervisor ------------------------------------------------------------------

    def _send(self, *message: object) -> None:
        channel = self._channel
        if channel is None:
            return  # between children: the next one starts from the store as it is then
        try:
            channel.send(*message)
        except OSError:
            pass  # the child is gone; the supervisor restarts it from the store

    def _loop(self) -> None:
        """One child, until it ends (``Supervised`` restarts it with backoff)."""
        why = self._run_child()
        if not self._ready.is_set():  # the first child failed: start() raises
            self._ready.set()
            return
        if not self._stop.is_set():
            raise SideChannelError(f"side-channel process {why}")

    def _run_child(self) -> str:
        """Start one child and serve it until it ends; says how it ended."""
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()] + ([] if self._sock is None else [self._sock.fileno()])
        cmd = [sys.executable, "-m", "kvbridge.handshake.process.child",
               "--control-fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        if self._sock is not None:
            cmd += ["--listen-fd", str(self._sock.fileno())]
        self._why_not_up = "side-channel process starting"
        try:
            proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL)
        except OSError as e:
            ours.close()
            self._start_error = SideChannelError(f"cannot start the side-channel process: {e}")
            return f"could not start ({e})"
        finally:
            theirs.close()
        self._why_not_up = f"side-channel process {proc.pid} starting"
        channel = Channel(ours)
        self._proc = proc
        try:
            last = self._handshake(channel, proc)
            if last is not None:
                self._serve(channel, last[0])
        except OSError as e:
            log.warning("kvbridge side channel: control socket: %s", e)
        finally:
            self._why_not_up = f"side-channel process {proc.pid} ended"
            self._channel, self._up = None, False
            with self._acks:
                self._acks.notify_all()  # a republish waiting: the next child has it
            channel.close()
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        return f"{proc.pid} exited with {_status(code)}"

    def _handshake(self, channel: Channel, proc: subprocess.Popen[bytes]
                   ) -> tuple[str | None] | None:
        """Hand the child what to serve and wait until it serves: the health it was given
        (None, and ``_start_error`` set on the first child, if it does not serve)."""
        try:
            self._spec.health = health = self._health_now()
            channel.send("start", self._spec)
            channel.sock.settimeout(self._start_timeout)
            first = channel.recv()
            error = None if first is not None and first[0] == "ready" else _error_of(first, proc)
        except Exception as e:  # noqa: BLE001 - whatever it is, start() must say it
            error = SideChannelError(f"the side-channel process did not start: "
                                     f"{type(e).__name__}: {e}")
        if error is not None:
            if not self._ready.is_set():
                self._start_error = error
            else:
                log.warning("kvbridge side channel: %s", error)
            if proc.poll() is None:
                proc.kill()
            return None
        assert first is not None
        if self._sock is None:
            self._port = first[1]
        for mirror in self._guards.values():  # a new child counts from zero
            mirror.restarted()
        self._last_pong = time.monotonic()
        self._channel, self._up = channel, True
        if not self._ready.is_set():
            log.info("kvbridge side channel: process %d serving %s on port %d", proc.pid,
                     self.method, self._port)
            self._ready.set()
        else:
            log.warning("kvbridge side channel: process restarted (pid %d)", proc.pid)
        return (health,)

    def _serve(self, channel: Channel, health: str | None) -> None:
        """Until the child ends: what it answered to the observer, the instance's health
        to it whenever it changes."""
        self._health_sent = health
        # No health to follow (the vLLM plug-in): wait for the child only, so this thread
        # in vLLM's engine core never wakes for nothing.
        channel.sock.settimeout(None if self._health is None else HEALTH_POLL)
        pinged, ping, answered = 0.0, 0, 0
        while True:
            try:
                message = channel.recv()
            except TimeoutError:
                message = ()
            if message is None:
                return
            # one ping outstanding at most: a stopped child's socket never fills up
            if (self._health is not None and answered == ping
                    and time.monotonic() - pinged >= PING_INTERVAL):
                pinged, ping = time.monotonic(), ping + 1
                channel.send("ping", ping)
            if message and message[0] == "pong":
                answered, self._last_pong = message[1], time.monotonic()
            elif message and message[0] == "observed":
                self._observed(message[1])
                for name, stats in message[2].items():
                    if name not in self._guards:
                        self._guards[name] = GuardMirror(name)
                    self._guards[name].update(stats)
            elif message and message[0] == "republished":
                with self._acks:
                    self._acked = max(self._acked, message[1])
                    self._acks.notify_all()
            now = self._health_now()
            if now != self._health_sent:
                self._health_sent = now
                channel.send("health", now)

    def _health_now(self) -> str | None:
        return None if self._health is None else self._health()

    def _observed(self, counts: dict[tuple[str, int], tuple[int, int]]) -> None:
        if self._observer is None:
            return
        # The observer counts one request per call: the bytes ride on the first.
        for (route, status), (n, nbytes) in counts.items():
            self._observer(route, status, nbytes)
            for _ in range(n - 1):
                self._observer(route, status, 0)


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


def _error_of(message: tuple | None, proc: subprocess.Popen[bytes]) -> BaseException:
    """The child's start-up error, as the exception type it raised when it is kvbridge's."""
    if message is None or message[0] != "error":
        code = proc.poll()
        return SideChannelError("the side-channel process exited before serving" +
                                ("" if code is None else f" ({_status(code)})"))
    _, name, text = message
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, errors.KVBridgeError):
        return kind(text)
    return SideChannelError(f"the side-channel process could not serve: {name}: {text}")
