"""Client side of the handshake for one local rank: background handshakes, cached peers.

``PeerManager.connect`` never blocks the caller: it returns a future (wait on
it, or poll ``done()``). Each handshake fetches only the remote ranks this
local rank reads from (see ``tp_mapping``), in parallel, each bounded by the
handshake timeout; it then adds the remote NIXL agents and prepares their
descriptor lists once. Peers are cached per engine id together with the
instance epoch they reported: a request that names another epoch makes the
cached peer stale, it is dropped and the handshake runs again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvbridge.errors import EpochChanged, PeerMismatch
from kvbridge.handshake.base import HandshakeClient
from kvbridge.metadata import RankMetadata
from kvbridge.tp_mapping import plan_reads
from kvbridge.transfer import NixlAgent, RemoteRank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandshakeEvent:
    """One finished handshake, for metrics: outcome "ok" or the error class name."""

    engine_id: str
    method: str
    seconds: float
    outcome: str


@dataclass
class Peer:
    """A remote instance as one local rank sees it."""

    engine_id: str
    epoch: str
    host: str
    port: int
    tp_size: int
    ranks: dict[int, RemoteRank]
    handshake_seconds: float


class PeerManager:
    """Handshakes and cached peers of one local rank (thread-safe)."""

    def __init__(self, agent: NixlAgent, local_rank: int, local_tp: int, total_kv_heads: int,
                 client_for: Callable[[str], HandshakeClient], max_parallel: int = 8):
        self.agent = agent
        self.local_rank = local_rank
        self.local_tp = local_tp
        self.total_kv_heads = total_kv_heads
        self._client_for = client_for
        self._lock = threading.Lock()
        self._peers: dict[str, Future[Peer]] = {}
        self._events: list[HandshakeEvent] = []
        # Two pools: a handshake waits on its rank fetches, which must not queue behind it.
        self._handshakes = ThreadPoolExecutor(max_parallel, thread_name_prefix="kvbridge-hs")
        self._fetches = ThreadPoolExecutor(max_parallel, thread_name_prefix="kvbridge-fetch")

    def connect(self, engine_id: str, host: str, port: int, remote_tp: int, *,
                method: str, epoch: str | None = None) -> Future[Peer]:
        """The peer for ``engine_id``, handshaking in the background when needed.

        With ``epoch`` given, a cached peer of another epoch is dropped and the
        handshake runs again; if the peer still reports another epoch the
        future fails with ``EpochChanged`` (the blocks named by the caller are gone).
        """
        stale: Peer | None = None
        with self._lock:
            fut = self._peers.get(engine_id)
            if fut is not None and fut.done():
                peer = None if fut.exception() else fut.result()
                if peer is None or (epoch is not None and peer.epoch != epoch):
                    stale, fut = peer, None
                    del self._peers[engine_id]
            if fut is None:
                if stale is not None:
                    # Before the new handshake, which may add the same remote agent again:
                    # removing it afterwards would break the new peer.
                    log.info("peer %s: epoch %s is stale, handshaking again", engine_id,
                             stale.epoch)
                    self._disconnect(stale)
                fut = self._handshakes.submit(self._timed, engine_id, host, port, remote_tp,
                                              method)
                self._peers[engine_id] = fut
        return _checked(fut, epoch, remote_tp)

    def invalidate(self, engine_id: str) -> None:
        """Forget a peer (e.g. after a failed transfer); the next connect handshakes again."""
        with self._lock:  # disconnect before a concurrent connect can add the agent again
            fut = self._peers.pop(engine_id, None)
            if fut is not None and fut.done() and not fut.exception():
                self._disconnect(fut.result())

    def close(self) -> None:
        """Cancel queued handshakes, wait for running ones (each bounded by the handshake
        timeout), then disconnect every peer: a handshake finishing after close would
        otherwise add a remote agent nobody removes."""
        self._handshakes.shutdown(wait=True, cancel_futures=True)
        self._fetches.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            futs, self._peers = list(self._peers.values()), {}
        for fut in futs:
            if fut.done() and not fut.exception():
                self._disconnect(fut.result())

    def cached(self, engine_id: str) -> Peer | None:
        """The peer for ``engine_id`` if a handshake with it succeeded (never blocks)."""
        with self._lock:
            fut = self._peers.get(engine_id)
            if fut is None or not fut.done() or fut.exception() is not None:
                return None
            return fut.result()

    def __len__(self) -> int:
        """Peers handshaken and cached now."""
        with self._lock:
            return sum(f.done() and f.exception() is None for f in self._peers.values())

    def drain_events(self) -> list[HandshakeEvent]:
        """Handshakes finished since the last call."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _timed(self, engine_id: str, host: str, port: int, remote_tp: int, method: str) -> Peer:
        t0 = time.monotonic()
        outcome = "ok"
        try:
            return self._handshake(engine_id, host, port, remote_tp, method)
        except Exception as e:
            outcome = type(e).__name__
            raise
        finally:
            with self._lock:
                self._events.append(HandshakeEvent(engine_id, method, time.monotonic() - t0,
                                                   outcome))

    def _handshake(self, engine_id: str, host: str, port: int, remote_tp: int,
                   method: str) -> Peer:
        t0 = time.monotonic()
        slices = plan_reads(self.local_rank, self.local_tp, remote_tp, self.total_kv_heads)
        wanted = sorted({s.remote_rank for s in slices})
        client = self._client_for(method)
        futs = {r: self._fetches.submit(client.fetch, host, port, r) for r in wanted}
        metas: dict[int, RankMetadata] = {r: f.result()[0] for r, f in futs.items()}
        epochs = {m.epoch for m in metas.values()}
        for r, m in metas.items():
            if m.engine_id != engine_id:
                raise PeerMismatch(f"{host}:{port} is engine {m.engine_id!r}, "
                                     f"expected {engine_id!r}")
            if m.tp_size != remote_tp:
                raise PeerMismatch(f"{engine_id} rank {r} reports tp_size {m.tp_size}, "
                                     f"expected {remote_tp}")
        if len(epochs) != 1:
            raise EpochChanged(f"{engine_id} restarted during the handshake (epochs {epochs})")
        ranks: dict[int, RemoteRank] = {}
        try:
            for r, m in metas.items():
                ranks[r] = self.agent.connect(m, [s for s in slices if s.remote_rank == r])
        except Exception:
            for rr in ranks.values():
                self.agent.disconnect(rr)
            raise
        peer = Peer(engine_id, epochs.pop(), host, port, remote_tp, ranks,
                    time.monotonic() - t0)
        log.info("rank %d: handshake with %s (ranks %s, epoch %s) took %.1f ms via %s",
                 self.local_rank, engine_id, wanted, peer.epoch[:8],
                 1000 * peer.handshake_seconds, method)
        return peer

    def _disconnect(self, peer: Peer) -> None:
        for rr in peer.ranks.values():
            try:
                self.agent.disconnect(rr)
            except Exception as e:  # a dead peer's agent may already be gone
                log.debug("disconnect %s: %s", rr.agent_name, e)


def _checked(fut: Future[Peer], epoch: str | None, tp_size: int) -> Future[Peer]:
    """``fut``, failing if the peer is not what the request says (TP size, epoch)."""
    out: Future[Peer] = Future()

    def done(f: Future[Peer]) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
            return
        peer = f.result()
        if peer.tp_size != tp_size:
            out.set_exception(PeerMismatch(
                f"{peer.engine_id} runs tp_size {peer.tp_size}, the request named {tp_size}"))
        elif epoch is not None and peer.epoch != epoch:
            out.set_exception(EpochChanged(
                f"{peer.engine_id} now runs epoch {peer.epoch[:8]}, the request "
                f"named {epoch[:8]}: its blocks are gone"))
        else:
            out.set_result(peer)

    fut.add_done_callback(done)
    return out
