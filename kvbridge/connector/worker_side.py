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
from dataclasses import dataclass

import torch

from kvbridge.config import DEFAULT_TRANSFER_TIMEOUT, SideChannelConfig
from kvbridge.connector.messages import (
    LoadSpec,
    PeerSpec,
    WorkerMeta,
    WorkerOutput,
    decode_notif,
    encode_notif,
    encode_release,
)
from kvbridge.errors import (
    FailureKind,
    InvalidBlockIds,
    KVBridgeError,
    LoadFailure,
    PeerMismatch,
    UntrustedSideChannel,
)
from kvbridge.handshake import HandshakeClient, make_client
from kvbridge.metadata import compat_of, encode_rank
from kvbridge.peers import Peer, PeerManager
from kvbridge.transfer import NixlAgent, PendingRead, RemoteRank

log = logging.getLogger(__name__)


@dataclass
class _Load:
    spec: LoadSpec
    peer: Future[Peer]
    fence: float                    # monotonic: every READ must be over by then
    reads: list[PendingRead] | None = None   # None until the READs start
    validating: bool = False        # the data READs are done; ``reads`` READ the block tags
    ranks: list[RemoteRank] | None = None
    deadline: float = float("inf")  # the transfer timeout, once the READs started
    # Set when the load failed; it is reported only once no READ of it can still land.
    failure: LoadFailure | None = None
    report: bool = True             # False once the head forgot it (cancelled)


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
        self._stale: set[str] = set()  # peers to forget once no READ uses them

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
                if (load := self._loads.get(rid)) is not None:
                    load.report = False
                    load.failure = load.failure or LoadFailure(FailureKind.ABORTED, "cancelled")
            for spec in meta.loads:
                self._start(spec)
            for engine_id, remote_rid, key in meta.releases:
                self._send_release(engine_id, remote_rid, key)
        for rid, load in list(self._loads.items()):
            try:
                ended = self._advance(load)
            except Exception as e:  # one request's failure must never stop the engine
                log.exception("load of %s failed unexpectedly", rid)
                load.failure = LoadFailure(FailureKind.TRANSFER, f"{type(e).__name__}: {e}")
                self._drop_peer(load.spec.remote_engine_id)
                ended = self._abort_reads(load)
            if not ended:
                continue
            del self._loads[rid]
            if not load.report:
                continue
            if load.failure is None:
                out.loaded.append(rid)
            else:
                out.failed[rid] = load.failure
                # Every READ of it is over: the prefill need not hold the blocks any longer.
                self._send_release(load.spec.remote_engine_id, load.spec.remote_request_id,
                                   load.spec.hold_key)
        self._invalidate_idle_stale_peers()
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

    def peer_count(self) -> int:
        """Remote instances this rank has handshaken with and caches."""
        return 0 if self.peers is None else len(self.peers)

    def close(self) -> None:
        """Abort loads in flight, wait for running handshakes, release every NIXL handle,
        remove remote agents and deregister the cache (``NixlAgent.close``)."""
        if self.agent is not None:
            for load in self._loads.values():
                self._abort_reads(load)
        self._loads.clear()
        if self.peers is not None:
            self.peers.close()
        for c in self._clients.values():
            c.close()
        if self.agent is not None:
            self.agent.close()

    # -- helpers -----------------------------------------------------------------------------

    def clear_block_tags(self, block_ids: list[int]) -> None:
        """KV is about to be written into these blocks (see kvbridge.kv_tags)."""
        assert self.agent is not None
        self.agent.clear_tags(block_ids)

    def set_block_tags(self, pairs: list[tuple[int, int]]) -> None:
        assert self.agent is not None
        self.agent.set_tags(pairs)

    def _client(self, method: str) -> HandshakeClient:
        if method not in self._clients:
            # keep_warm: a known peer's connection outlives its keep-alive, so the next
            # handshake with it (a new epoch, an invalidated peer) is a warm fetch
            self._clients[method] = make_client(self.spec.side_channel, self._compat, method,
                                                keep_warm=True)
        return self._clients[method]

    def _start(self, spec: LoadSpec) -> None:
        assert self.peers is not None
        fut = self.peers.connect(spec.remote_engine_id, spec.remote_host, spec.remote_port,
                                 spec.remote_tp_size, method=spec.method, epoch=spec.remote_epoch)
        # The READ writes into these blocks: their old tags no longer name their content.
        assert self.agent is not None
        self.agent.clear_tags(spec.local_block_ids)
        # The handshake bounds itself; the READs get their own bound once they start.
        self._loads[spec.request_id] = _Load(spec, fut,
                                             fence=time.monotonic() + spec.fence_seconds)

    def _advance(self, load: _Load) -> bool:
        """Move one load on; True once it ended: every READ it started is over (done,
        failed or cancelled, handles released) and it has loaded or failed."""
        if load.failure is None:
            load.failure = self._progress(load)
        if load.failure is not None:
            return self._abort_reads(load)
        return load.reads is not None and not load.reads

    def _progress(self, load: _Load) -> LoadFailure | None:
        assert self.agent is not None and self.peers is not None
        spec = load.spec
        now = time.monotonic()
        if load.reads is None:
            if now > load.fence:
                return LoadFailure(FailureKind.TRANSFER, "the prefill's lease on the blocks "
                                   "would end before the READ could finish")
            if not load.peer.done():
                return None
            if (exc := load.peer.exception()) is not None:
                # Not the peer named, or not one trusted with the token: the request's fault.
                kind = (FailureKind.INVALID_PARAMS
                        if isinstance(exc, PeerMismatch | UntrustedSideChannel)
                        else FailureKind.HANDSHAKE)
                return LoadFailure(kind, f"handshake with {spec.remote_host}:"
                                         f"{spec.remote_port} failed: {exc}")
            peer = load.peer.result()
            # The prefill frees the blocks once every rank's note arrived: the note goes
            # with the last READ (the tags', when the load is validated).
            notif = encode_notif(spec.remote_request_id, self.tp_rank, self.tp_size,
                                 spec.hold_key)
            load.reads = []
            load.ranks = list(peer.ranks.values())
            load.deadline = now + self.spec.transfer_timeout
            for rr in load.ranks:
                try:
                    load.reads.append(self.agent.read(
                        rr, spec.local_block_ids, spec.remote_block_ids,
                        b"" if spec.expected_tags is not None else notif))
                except InvalidBlockIds as e:
                    return LoadFailure(FailureKind.INVALID_PARAMS, f"remote_block_ids: {e}")
                except KVBridgeError as e:
                    # e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer died; handshake afresh next time
                    self._drop_peer(spec.remote_engine_id)
                    return LoadFailure(FailureKind.TRANSFER, f"READ from "
                                       f"{spec.remote_engine_id} could not start: {e}")
        still = []
        for pending in load.reads:
            state = self.agent.poll(pending)
            if state == "ERR":
                # The peer may have died or restarted: drop it so the next request handshakes.
                self._drop_peer(spec.remote_engine_id)
                return LoadFailure(FailureKind.TRANSFER, f"READ from {pending.agent_name} "
                                   "failed")
            if state == "PROC":
                still.append(pending)
        load.reads = still
        if not still and spec.expected_tags is not None:
            if not load.validating:
                return self._read_tags(load)
            return self._check_tags(load)
        if still and now > load.fence:
            return LoadFailure(FailureKind.TRANSFER, f"READ from {spec.remote_engine_id} not "
                               "done before the prefill's lease on the blocks ends")
        if still and now > load.deadline:
            self._drop_peer(spec.remote_engine_id)
            return LoadFailure(FailureKind.TRANSFER, f"READ from {spec.remote_engine_id} not "
                               f"done in {self.spec.transfer_timeout:g}s")
        return None

    def _read_tags(self, load: _Load) -> LoadFailure | None:
        """The blocks are here: READ their tags to learn whether they held our prompt's KV
        for the whole READ (optimistic read, then validate; see kvbridge.kv_tags)."""
        assert self.agent is not None and load.ranks is not None
        spec = load.spec
        notif = encode_notif(spec.remote_request_id, self.tp_rank, self.tp_size, spec.hold_key)
        load.validating = True
        try:
            load.reads = [self.agent.read_tags(rr, spec.local_block_ids, spec.remote_block_ids,
                                               notif) for rr in load.ranks]
        except KVBridgeError as e:
            self._drop_peer(spec.remote_engine_id)
            return LoadFailure(FailureKind.TRANSFER, f"READ of the block tags from "
                               f"{spec.remote_engine_id} could not start: {e}")
        return None

    def _check_tags(self, load: _Load) -> LoadFailure | None:
        assert self.agent is not None and load.ranks is not None
        spec = load.spec
        expected = spec.expected_tags
        for rr in load.ranks:
            got = self.agent.tags_read(rr, spec.local_block_ids)
            if got != expected:
                bad = next(i for i, (g, e) in enumerate(zip(got, expected, strict=True))
                           if g != e)
                return LoadFailure(FailureKind.STALE, (
                    f"remote block {spec.remote_block_ids[bad]} (position {bad}) of "
                    f"{spec.remote_engine_id} rank {rr.meta.tp_rank} does not hold this "
                    "prompt's KV (blocks reordered, another prompt, or the hold released "
                    "and its blocks reused): the READ is not used"))
        return None

    def _send_release(self, engine_id: str, remote_request_id: str,
                      hold_key: str | None) -> None:
        """Tell a prefill we will not read a request's blocks, over NIXL, when we have a
        working connection to it; otherwise its lease frees them."""
        assert self.agent is not None and self.peers is not None
        peer = self.peers.cached(engine_id)
        if peer is None or engine_id in self._stale:
            return
        remote = next(iter(peer.ranks.values()))
        try:
            self.agent.send_notification(remote, encode_release(remote_request_id, hold_key))
        except KVBridgeError as e:
            log.debug("release of %s on %s not sent: %s", remote_request_id, engine_id, e)

    def _abort_reads(self, load: _Load) -> bool:
        """Cancel the load's READs still in flight; True once none is left. One NIXL cannot
        cancel is polled on later steps: until it ends, it may still write into our blocks,
        so the load is not reported (and no recompute starts) before then."""
        assert self.agent is not None
        load.reads = [r for r in (load.reads or [])
                      if not self.agent.abort(r) and self.agent.poll(r) == "PROC"]
        return not load.reads

    def _drop_peer(self, engine_id: str) -> None:
        """Forget a broken peer. Its descriptor lists are released only once no READ of
        any load uses them: the loads on it fail and cancel their READs first."""
        for load in self._loads.values():
            if load.spec.remote_engine_id == engine_id and load.reads:
                load.failure = load.failure or LoadFailure(
                    FailureKind.TRANSFER, f"peer {engine_id} failed during the READ")
                self._abort_reads(load)
        self._stale.add(engine_id)
        self._invalidate_idle_stale_peers()

    def _invalidate_idle_stale_peers(self) -> None:
        assert self.peers is not None
        for engine_id in list(self._stale):
            if not any(load.spec.remote_engine_id == engine_id and load.reads
                       for load in self._loads.values()):
                self._stale.discard(engine_id)
                self.peers.invalidate(engine_id)
