"""Worker side of the NIXL connector (one per TP worker process): registers the KV
cache with a NIXL agent, handshakes with the prefill ranks it needs (in the
background), READs its head slices, and reports what finished.

``step`` never blocks on the network: handshakes run in ``PeerManager``'s
threads and READs are polled. Every load ends, within the handshake timeout or
the transfer timeout, as loaded or failed (with the reason).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvbridge.config import SideChannelConfig
from kvbridge.connector.base import INVALID_PARAMS
from kvbridge.connector.messages import (
    LoadSpec,
    PeerSpec,
    WorkerMeta,
    WorkerOutput,
    decode_notif,
    encode_notif,
)
from kvbridge.errors import InvalidBlockIds, KVBridgeError, PeerMismatch
from kvbridge.handshake import HandshakeClient, make_client
from kvbridge.metadata import compat_of, encode_rank
from kvbridge.peers import Peer, PeerManager
from kvbridge.transfer import NixlAgent, PendingRead

log = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT = 30.0


@dataclass
class _Load:
    spec: LoadSpec
    peer: Future[Peer]
    deadline: float
    reads: list[PendingRead] | None = None
    done: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NixlWorkerConnectorFactory:
    """Picklable: the engine calls it in each worker process as ``factory(tp_rank, tp_size)``."""

    engine_id: str
    epoch: str
    model: str
    total_kv_heads: int
    side_channel: SideChannelConfig
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT

    def __call__(self, tp_rank: int, tp_size: int) -> NixlWorkerConnector:
        return NixlWorkerConnector(self, tp_rank, tp_size)


class NixlWorkerConnector:
    """Implements ``kvbridge.connector.base.WorkerConnector``."""

    def __init__(self, spec: NixlWorkerConnectorFactory, tp_rank: int, tp_size: int):
        self.spec = spec
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.agent: NixlAgent | None = None
        self.peers: PeerManager | None = None
        self._clients: dict[str, HandshakeClient] = {}
        self._loads: dict[str, _Load] = {}

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.agent = NixlAgent(f"kvbridge-{self.spec.engine_id[:8]}-{self.spec.epoch[:8]}-"
                               f"tp{self.tp_rank}")
        kv = self.agent.register_kv_cache(kv_cache, self.spec.total_kv_heads)
        self._compat = compat_of(self.spec.model, kv)
        self.peers = PeerManager(self.agent, self.tp_rank, self.tp_size,
                                 self.spec.total_kv_heads, self._client)

    def handshake_metadata(self) -> bytes:
        assert self.agent is not None, "register_kv_cache first"
        return encode_rank(self.agent.rank_metadata(self.spec.engine_id, self.spec.epoch,
                                                     self.tp_rank, self.tp_size))

    def step(self, meta: WorkerMeta | None) -> WorkerOutput | None:
        assert self.agent is not None and self.peers is not None
        out = WorkerOutput(self.tp_rank)
        if meta is not None:
            for rid in meta.cancelled:
                self._loads.pop(rid, None)
            for spec in meta.loads:
                self._start(spec)
        for rid, load in list(self._loads.items()):
            try:
                err = self._advance(load)
            except Exception as e:  # one request's failure must never stop the engine
                log.exception("load of %s failed unexpectedly", rid)
                self.peers.invalidate(load.spec.remote_engine_id)
                err = f"{type(e).__name__}: {e}"
            if err is None and load.reads is not None and not load.reads:
                out.loaded.append(rid)
                del self._loads[rid]
            elif err is not None:
                out.failed[rid] = err
                del self._loads[rid]
        out.handshakes = [(e.engine_id, e.method, e.seconds, e.outcome)
                          for e in self.peers.drain_events()]
        for msgs in self.agent.notifications().values():
            for msg in msgs:
                note = decode_notif(msg)
                if note is not None:
                    out.notified.append(note)
        return None if out.empty() else out

    def prewarm(self, peer: PeerSpec) -> bool:
        """Start the handshake with ``peer`` now, so the first request finds it cached.

        Returns at once (the handshake runs in the background): True when one is under
        way, False when the peer was already cached. A failed one is retried on first use.
        """
        assert self.peers is not None
        return not self.peers.connect(peer.engine_id, peer.host, peer.port, peer.tp_size,
                                      method=peer.method, epoch=peer.epoch).done()

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        for c in self._clients.values():
            c.close()

    # -- helpers -----------------------------------------------------------------------------

    def _client(self, method: str) -> HandshakeClient:
        if method not in self._clients:
            self._clients[method] = make_client(self.spec.side_channel, self._compat, method)
        return self._clients[method]

    def _start(self, spec: LoadSpec) -> None:
        assert self.peers is not None
        fut = self.peers.connect(spec.remote_engine_id, spec.remote_host, spec.remote_port,
                                 spec.remote_tp_size, method=spec.method, epoch=spec.remote_epoch)
        # The handshake bounds itself; the READs get their own bound once they start.
        self._loads[spec.request_id] = _Load(spec, fut, deadline=float("inf"))

    def _advance(self, load: _Load) -> str | None:
        """Move one load on; returns an error message when it failed."""
        assert self.agent is not None and self.peers is not None
        spec = load.spec
        if load.reads is None:
            if not load.peer.done():
                return None
            if (exc := load.peer.exception()) is not None:
                why = INVALID_PARAMS if isinstance(exc, PeerMismatch) else "handshake"
                return f"{why}: handshake with {spec.remote_host}:{spec.remote_port} failed: {exc}"
            peer = load.peer.result()
            notif = encode_notif(spec.remote_request_id, self.tp_rank, self.tp_size)
            try:
                load.reads = [self.agent.read(rr, spec.local_block_ids, spec.remote_block_ids,
                                              notif) for rr in peer.ranks.values()]
            except InvalidBlockIds as e:
                return f"{INVALID_PARAMS}: remote_block_ids: {e}"
            except KVBridgeError as e:
                # e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer died; handshake afresh next time
                self.peers.invalidate(spec.remote_engine_id)
                return f"READ from {spec.remote_engine_id} could not start: {e}"
            load.deadline = time.monotonic() + self.spec.transfer_timeout
        still = []
        for pending in load.reads:
            state = self.agent.poll(pending)
            if state == "ERR":
                # The peer may have died or restarted: drop it so the next request handshakes.
                self.peers.invalidate(spec.remote_engine_id)
                return f"READ from {pending.agent_name} failed"
            if state == "PROC":
                still.append(pending)
        load.reads = still
        if still and time.monotonic() > load.deadline:
            self.peers.invalidate(spec.remote_engine_id)
            return f"READ from {spec.remote_engine_id} not done in {self.spec.transfer_timeout:g}s"
        return None
