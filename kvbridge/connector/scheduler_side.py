"""Scheduler side of the NIXL connector (head process): ``kv_transfer_params`` in and out,
leases on held blocks, which requests wait for remote KV, and the side channel.

Prefill: a request with ``do_remote_decode`` keeps its blocks after it finishes,
under a lease, and answers with the params a decode needs to read them. The
blocks are released when every consuming decode rank has notified, or when the
lease expires.

Decode: a request with ``do_remote_prefill`` and remote block ids waits for its
KV; the workers handshake and READ; the aggregated result tells the engine to
continue from the transferred KV or to apply its failure policy.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbridge.config import DEFAULT_LEASE_SECONDS, METHODS, SideChannelConfig
from kvbridge.connector.aggregator import LoadAggregator, SendAggregator
from kvbridge.connector.base import ConnectorUpdate
from kvbridge.connector.messages import (
    RELEASE_RANK,
    LoadSpec,
    PeerSpec,
    WorkerMeta,
    WorkerOutput,
)
from kvbridge.errors import (
    ConfigError,
    FailureKind,
    HandshakeError,
    InvalidKVTransferParams,
    LoadFailure,
)
from kvbridge.handshake import HandshakeServer, MetadataStore, make_client, side_channel
from kvbridge.kv_tags import block_tags
from kvbridge.metadata import Compat, decode_rank
from kvbridge.metrics import Metrics
from kvbridge.params import KVTransferParams

log = logging.getLogger(__name__)


def lease_margin(lease_seconds: float) -> float:
    """How long before the prefill's lease ends a decode gives up its READs: covers the
    time the prefill's answer spent travelling to the decode, and a READ being cancelled."""
    return min(2.0 + 0.1 * lease_seconds, 0.5 * lease_seconds)


class NixlSchedulerConnector:
    """Implements ``kvbridge.connector.base.SchedulerConnector``."""

    tags_blocks = True  # peers READ our blocks: the engine keeps their tags (kvbridge.kv_tags)

    def __init__(self, *, engine_id: str, epoch: str, tp_size: int, total_kv_heads: int,
                 block_size: int, block_bytes: int, side_channel: SideChannelConfig,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, metrics: Metrics | None = None,
                 recompute_on_failure: bool = True):
        self.engine_id = engine_id
        self.epoch = epoch
        self.tp_size = tp_size
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block, all layers, all ranks: for the byte metrics
        self.side_channel = side_channel
        self.lease_seconds = lease_seconds
        self.metrics = metrics or Metrics()
        self.recompute_on_failure = recompute_on_failure  # the engine's policy, for metrics
        self._loads = LoadAggregator(tp_size)
        self._sends = SendAggregator(tp_size, total_kv_heads)
        # decode: requests awaiting KV -> (params, blocks to load, arrival time, their tags)
        self._want: dict[str, tuple[KVTransferParams, int, float, list[int]]] = {}
        self._new_loads: list[LoadSpec] = []
        self._cancelled: list[str] = []
        # decode: holds to give back unread, as (engine id, request id, hold key)
        self._releases: list[tuple[str, str, str | None]] = []
        self._load_started: dict[str, float] = {}
        self._load_blocks: dict[str, int] = {}
        self._refused: dict[str, LoadFailure] = {}        # loads failed before reaching workers
        self._leases: dict[str, float] = {}               # prefill: request id -> lease deadline
        self._hold_keys: dict[str, str] = {}              # prefill: request id -> hold key
        self._prewarms: dict[str, tuple[int, float]] = {}  # engine id -> (ranks left, deadline)
        self._prewarm_lock = threading.Lock()  # prewarms are announced from API threads
        self._abandoned: set[str] = set()  # held requests released from an API thread
        self._abandoned_lock = threading.Lock()
        self.compat: Compat | None = None  # set by the instance once the workers are up
        self.server: HandshakeServer | None = None
        self.store: MetadataStore | None = None

    # -- side channel ----------------------------------------------------------------------

    def start_side_channel(self, compat: Compat, worker_metadata: list[bytes],
                           rank_hosts: dict[int, str] | None = None,
                           health: Callable[[], str | None] | None = None) -> HandshakeServer:
        """Serve every worker's metadata (gathered by the head) on one port, in a process
        of its own unless ``side_channel_isolation`` is ``thread``. ``rank_hosts``: where
        each rank lives (shown in the JSON view); ``health``: why the instance cannot serve
        KV now (None: it can)."""
        self.compat = compat
        self.store = MetadataStore(compat, self.tp_size)
        self.store.rank_hosts = dict(rank_hosts or {})
        for raw in worker_metadata:
            meta = decode_rank(raw)
            if meta.engine_id != self.engine_id or meta.epoch != self.epoch:
                raise ValueError(f"worker {meta.tp_rank} reports engine {meta.engine_id} "
                                 f"epoch {meta.epoch}, expected {self.engine_id} {self.epoch}")
            self.store.set_rank(meta)
        self.server = side_channel(self.side_channel, self.store,
                                   observer=self.metrics.observe_side_channel, health=health)
        self.server.start()
        return self.server

    def discover(self, host: str, port: int, method: str | None = None) -> PeerSpec:
        """Ask a prefill's side channel who it is (engine id, TP size, epoch): blocking,
        bounded by the handshake timeout. Used to handshake before the first request."""
        try:
            method = self._method(method)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        client = make_client(self.side_channel, self.compat, method)
        try:
            ranks = client.fetch(host, port, None)
        finally:
            client.close()
        first = ranks[0]
        if len(ranks) != first.tp_size or {(r.engine_id, r.epoch) for r in ranks} != {
                (first.engine_id, first.epoch)}:
            raise HandshakeError(f"{host}:{port} answered an inconsistent set of ranks")
        return PeerSpec(first.engine_id, host, port, first.tp_size, first.epoch, method)

    def _method(self, requested: object) -> str:
        """The handshake method a peer asks for, if we accept it: an http instance never
        lets a request talk it down to zmq (unauthenticated, unencrypted)."""
        method = str(requested or self.side_channel.handshake_method)
        if method not in METHODS:
            raise ValueError(f"unknown handshake_method {method!r}")
        if self.side_channel.handshake_method == "http" and method == "zmq":
            raise ValueError("this instance uses the http handshake and refuses zmq")
        return method

    def expect_prewarm(self, engine_id: str, workers: int) -> None:
        """``workers`` ranks started a handshake with ``engine_id`` ahead of any request:
        keep the engine stepping until they report (bounded by the handshake timeout)."""
        if workers:
            deadline = time.monotonic() + self.side_channel.handshake_timeout + 1
            with self._prewarm_lock:
                self._prewarms[engine_id] = (workers, deadline)

    def prewarming(self, engine_id: str) -> bool:
        with self._prewarm_lock:
            return engine_id in self._prewarms

    def has_pending(self) -> bool:
        if self._releases:
            return True  # one step sends them
        with self._prewarm_lock:
            now = time.monotonic()
            for eid in [e for e, (_, t) in self._prewarms.items() if t < now]:
                del self._prewarms[eid]
            return bool(self._prewarms)

    def _prewarm_seen(self, engine_id: str) -> None:
        with self._prewarm_lock:
            if engine_id in self._prewarms:
                left, deadline = self._prewarms[engine_id]
                if left <= 1:
                    del self._prewarms[engine_id]
                else:
                    self._prewarms[engine_id] = (left - 1, deadline)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # -- SchedulerConnector ------------------------------------------------------------------

    def num_remote_tokens(self, request_id: str, prompt_ids: list[int],
                          params: KVTransferParams | None) -> int:
        """Prompt tokens the remote KV covers (never more than its blocks hold: the rest
        is computed here). Raises ``InvalidKVTransferParams`` for params that name another
        prompt (see ``KVTransferParams.plan_load``)."""
        if params is None or not params.loads_remote_kv:
            return 0
        plan = params.check().plan_load(len(prompt_ids), self.block_size)
        if plan.num_tokens == 0:
            return 0
        tags = block_tags(prompt_ids, plan.num_tokens, self.block_size)
        self._want[request_id] = (params, plan.num_blocks, time.monotonic(), tags)
        return plan.num_tokens

    def on_blocks_allocated(self, request_id: str, block_ids: list[int]) -> None:
        want = self._want.pop(request_id, None)
        if want is None:
            return
        params, num_blocks, arrived, tags = want
        self._loads.expect(request_id)
        self._load_started[request_id] = time.monotonic()
        try:
            spec = self._load_spec(request_id, params, block_ids[:num_blocks], arrived, tags)
        except InvalidKVTransferParams as e:
            # Bad params fail this request alone, with a 400 (never recomputed).
            self._refused[request_id] = LoadFailure(FailureKind.INVALID_PARAMS, str(e))
            return
        self._load_blocks[request_id] = len(spec.local_block_ids)
        self._new_loads.append(spec)

    def _load_spec(self, request_id: str, p: KVTransferParams, local_blocks: list[int],
                   arrived: float, tags: list[int]) -> LoadSpec:
        try:
            method = self._method(p.handshake_method)
        except ValueError as e:
            raise InvalidKVTransferParams(f"handshake_method: {e}") from None
        assert p.remote_block_ids is not None and p.remote_port is not None
        fence = float("inf")
        if p.remote_lease_ms is not None:
            lease = p.remote_lease_ms / 1000
            fence = lease - lease_margin(lease) - (time.monotonic() - arrived)
        return LoadSpec(
            request_id=request_id, local_block_ids=list(local_blocks),
            remote_block_ids=list(p.remote_block_ids[:len(local_blocks)]),
            remote_request_id=p.remote_request_id or request_id,
            remote_engine_id=str(p.remote_engine_id), remote_host=str(p.remote_host),
            remote_port=p.remote_port, remote_tp_size=p.tp_size or 1,
            remote_epoch=p.remote_epoch, method=method, fence_seconds=fence,
            hold_key=p.remote_hold_key, expected_tags=tags[:len(local_blocks)])

    def on_refused(self, params: KVTransferParams) -> None:
        if params.loads_remote_kv and params.remote_engine_id and params.remote_request_id:
            self._releases.append((params.remote_engine_id, params.remote_request_id,
                                   params.remote_hold_key))

    def build_worker_meta(self) -> WorkerMeta:
        meta = WorkerMeta(self._new_loads, self._cancelled, self._releases)
        self._new_loads, self._cancelled, self._releases = [], [], []
        return meta

    def update(self, worker_outputs: list[Any | None]) -> ConnectorUpdate:
        out = ConnectorUpdate()
        for rid, err in self._refused.items():
            self._loads.forget(rid)
            out.loaded[rid] = err
            self._record_load(rid, err)
        self._refused.clear()
        for wo in worker_outputs:
            if wo is None:
                continue  # this worker had nothing to say this step
            assert isinstance(wo, WorkerOutput)
            for engine_id, method, seconds, outcome in wo.handshakes:
                self.metrics.handshake_seconds.labels(method, outcome).observe(seconds)
                self._prewarm_seen(engine_id)
            for rid, err in self._loads.fold(wo.loaded, wo.failed).items():
                out.loaded[rid] = err
                self._record_load(rid, err)
            notes = self._keyed(wo.notified)
            for remote_rid, _, _ in [n for n in notes if n[1] == RELEASE_RANK]:
                if remote_rid in self._leases:  # a decode will not read it
                    self._sends.forget(remote_rid)
                    out.released.add(self._release(remote_rid))
                    self.metrics.held_released.labels("abandoned").inc()
            done = self._sends.fold(wo.tp_rank, [n for n in notes if n[1] != RELEASE_RANK],
                                    self._leases)
            for remote_rid in done:
                out.released.add(self._release(remote_rid))
                self.metrics.held_released.labels("read").inc()
        with self._abandoned_lock:
            abandoned, self._abandoned = self._abandoned, set()
        for remote_rid in abandoned & self._leases.keys():
            self._sends.forget(remote_rid)
            out.released.add(self._release(remote_rid))
            self.metrics.held_released.labels("abandoned").inc()
        now = time.monotonic()
        for remote_rid in [r for r, t in self._leases.items() if t <= now]:
            log.warning("lease of request %s expired before every decode rank read it",
                        remote_rid)
            self._sends.forget(remote_rid)
            out.released.add(self._release(remote_rid))
            self.metrics.held_released.labels("lease_expired").inc()
        return out

    def on_finished(self, request_id: str, block_ids: list[int],
                    params: KVTransferParams | None, num_computed_tokens: int
                    ) -> tuple[bool, KVTransferParams | None]:
        if request_id in self._want or request_id in self._load_started:
            # finished (aborted) while its load was in flight: workers drop it
            self._want.pop(request_id, None)
            self._loads.forget(request_id)
            self._load_started.pop(request_id, None)
            self._load_blocks.pop(request_id, None)
            self._refused.pop(request_id, None)
            self._cancelled.append(request_id)
        if params is None or not params.do_remote_decode or not block_ids:
            return False, None
        # Name only the blocks that hold computed KV (the sampled token has none yet).
        held = block_ids[:-(-num_computed_tokens // self.block_size)]
        if not held:
            return False, None
        self._leases[request_id] = time.monotonic() + self.lease_seconds
        self._hold_keys[request_id] = key = secrets.token_hex(16)
        self.metrics.held_requests.inc()
        port = self.server.port if self.server is not None else self.side_channel.side_channel_port
        return True, KVTransferParams(
            do_remote_prefill=True, do_remote_decode=False, remote_engine_id=self.engine_id,
            remote_block_ids=list(held), remote_request_id=request_id,
            remote_host=self.side_channel.advertised, remote_port=port, tp_size=self.tp_size,
            remote_epoch=self.epoch, handshake_method=self.side_channel.handshake_method,
            remote_num_tokens=num_computed_tokens,
            remote_lease_ms=int(self.lease_seconds * 1000), remote_hold_key=key)

    def release(self, request_id: str, hold_key: str | None) -> bool:
        """Free a held request's blocks now (nobody will read them: the decode refused the
        request or is gone). Thread-safe; the engine frees the blocks on its next step.
        False when the request is not held (read already, expired, or unknown) or
        ``hold_key`` is not the key its params carried (ignored, and counted)."""
        return self.release_outcome(request_id, hold_key) == "released"

    def release_outcome(self, request_id: str, hold_key: str | None) -> str:
        """``release``, saying which: ``released``, ``not held`` (read already, expired,
        unknown) or ``wrong key`` (held, but not with this key: ignored, and counted)."""
        if request_id not in self._leases:
            return "not held"
        if not _same_key(self._hold_keys.get(request_id), hold_key):
            self.metrics.kv_notes_ignored.labels("bad_key").inc()
            return "wrong key"
        with self._abandoned_lock:
            self._abandoned.add(request_id)
        return "released"

    # -- helpers -----------------------------------------------------------------------------

    @property
    def num_held(self) -> int:
        return len(self._leases)

    def _keyed(self, notes: list[tuple[str, int, int, str | None]]
               ) -> list[tuple[str, int, int]]:
        """The notes that carry their hold's key; the others are ignored and counted (a
        note for a request not held is dropped later, unkeyed or not)."""
        kept = []
        for rid, rank, size, key in notes:
            if rid in self._leases and not _same_key(self._hold_keys.get(rid), key):
                self.metrics.kv_notes_ignored.labels("bad_key").inc()
                log.warning("ignored a %s note for held request %s without its hold key",
                            "release" if rank == RELEASE_RANK else "READ-done", rid[:128])
                continue
            kept.append((rid, rank, size))
        return kept

    def _release(self, request_id: str) -> str:
        del self._leases[request_id]
        self._hold_keys.pop(request_id, None)
        self.metrics.held_requests.dec()
        return request_id

    def _record_load(self, rid: str, err: LoadFailure | None) -> None:
        started = self._load_started.pop(rid, time.monotonic())
        blocks = self._load_blocks.pop(rid, 0)
        if err is None:
            self.metrics.kv_loads.labels("ok").inc()
            self.metrics.kv_blocks_loaded.inc(blocks)
            self.metrics.kv_bytes_loaded.inc(blocks * self.block_bytes)
            self.metrics.kv_load_seconds.observe(time.monotonic() - started)
        else:
            self.metrics.kv_loads.labels("failed").inc()
            if err.kind is FailureKind.STALE:
                self.metrics.kv_loads_stale.inc()
            if self.recompute_on_failure and not err.request_fault:
                self.metrics.requests_recomputed.inc()
            log.warning("KV load of request %s failed: %s", rid, err)


def _same_key(expected: str | None, given: str | None) -> bool:
    return expected is None or (given is not None
                                and secrets.compare_digest(expected.encode(), given.encode()))
