"""The NIXL data plane: a NIXL agent owning one registered KV cache, block/head-slice
descriptors, READs and notifications."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbridge._nixl import new_agent, nixl_api
from kvbridge.errors import InvalidBlockIds, TransferError
from kvbridge.kv_cache import kv_layout
from kvbridge.metadata import KVLayout, RankMetadata
from kvbridge.tp_mapping import HeadSlice


def slice_descs(kv: KVLayout, head: int, num_heads: int) -> np.ndarray:
    """Nx3 (addr, len, dev) descriptors of a head range in every (region, block).

    Row ``region * num_blocks + block``; ``block_indices`` computes rows.
    """
    regions = np.asarray(kv.base_addrs, dtype=np.uint64)[:, None]
    blocks = np.arange(kv.num_blocks, dtype=np.uint64)[None, :] * np.uint64(kv.block_len)
    addrs = (regions + blocks + np.uint64(head * kv.head_len)).reshape(-1)
    out = np.zeros((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = num_heads * kv.head_len
    return out


def block_indices(block_ids: Sequence[int], num_blocks: int, num_regions: int,
                  slice_index: int = 0) -> np.ndarray:
    """Rows of ``slice_descs`` (stacked per slice) for these blocks in every region."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise InvalidBlockIds(f"block id out of range 0..{num_blocks - 1}")
    base = slice_index * num_regions * num_blocks
    return (base + np.arange(num_regions, dtype=np.int64)[:, None] * num_blocks
            + ids[None, :]).reshape(-1)


@dataclass
class RemoteRank:
    """One remote rank we read from: its agent and the prepared descriptor lists."""

    meta: RankMetadata
    agent_name: str
    slices: list[HeadSlice]
    remote_dlist: Any = None
    local_dlist: Any = None
    # Block tags (kvbridge.kv_tags): the peer's tag array, READ into a scratch array of
    # our own (one slot per local block: a load's local blocks are its own).
    tags_dlist: Any = None
    scratch_dlist: Any = None
    scratch: np.ndarray | None = None
    scratch_reg: Any = None


@dataclass
class PendingRead:
    handle: Any
    agent_name: str
    started: float = field(default_factory=time.monotonic)


class NixlAgent:
    """A NIXL agent owning one registered KV cache: the wrapper the rest of kvbridge uses."""

    def __init__(self, name: str | None = None):
        api = nixl_api()
        self.name = name or f"kvbridge-{uuid.uuid4().hex[:12]}"
        self._agent = new_agent(api, self.name)
        self._reg = None
        self.kv: KVLayout | None = None
        self._kv_tensor: torch.Tensor | None = None
        self.tags: np.ndarray | None = None  # one tag per KV block (kvbridge.kv_tags)
        self._tags_reg = None
        # Handshake threads connect peers while the worker thread reads and polls.
        self._lock = threading.RLock()
        self._peers: dict[int, RemoteRank] = {}      # id() -> connected remote ranks
        self._reads: dict[int, PendingRead] = {}     # id() -> READs not yet released
        self._closed = False

    def register_kv_cache(self, kv_cache: torch.Tensor, total_kv_heads: int) -> KVLayout:
        """Register the whole cache as one region (one registration key to ship)."""
        self._kv_tensor = kv_cache  # keep the memory alive while registered
        self._reg = self._agent.register_memory(
            [(kv_cache.data_ptr(), kv_cache.nbytes, 0, "")], mem_type="DRAM")
        self.kv = kv_layout(kv_cache, total_kv_heads)
        self.tags = np.zeros(self.kv.num_blocks, dtype=np.uint64)
        self._tags_reg = self._agent.register_memory(
            [(self.tags.ctypes.data, self.tags.nbytes, 0, "")], mem_type="DRAM")
        return self.kv

    def clear_tags(self, block_ids: Sequence[int]) -> None:
        """Before KV is written into these blocks: they no longer hold known content."""
        assert self.tags is not None
        self.tags[np.asarray(block_ids, dtype=np.int64)] = 0

    def set_tags(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Once KV is written: (block id, tag) of each block's new content."""
        assert self.tags is not None
        for block, tag in pairs:
            self.tags[block] = tag

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def connect(self, meta: RankMetadata, slices: list[HeadSlice]) -> RemoteRank:
        """Add the remote agent and prepare both sides' descriptor lists once."""
        if self.kv is None:
            raise TransferError("register the KV cache before connecting to peers")
        if meta.kv.head_len != self.kv.head_len:
            raise TransferError(f"remote head length {meta.kv.head_len} B differs from ours "
                                f"{self.kv.head_len} B")
        remote = np.concatenate([slice_descs(meta.kv, s.remote_head, s.num_heads)
                                 for s in slices])
        local = np.concatenate([slice_descs(self.kv, s.local_head, s.num_heads)
                                for s in slices])
        with self._lock:
            if self._closed:
                raise TransferError("the NIXL agent is closed")
            try:  # NIXL raises its own exception types (bad metadata, unknown agent, ...)
                agent_name = self._agent.add_remote_agent(meta.agent_metadata)
            except Exception as e:
                raise TransferError(f"cannot add remote agent {meta.agent_name!r}: "
                                    f"{type(e).__name__}: {e}") from e
            if isinstance(agent_name, bytes):
                agent_name = agent_name.decode()
            peer = RemoteRank(meta, agent_name, slices)
            self._peers[id(peer)] = peer
            try:
                peer.remote_dlist = self._agent.prep_xfer_dlist(agent_name, remote, "DRAM")
                peer.local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
                self._prep_tags(peer)
            except Exception as e:
                self.disconnect(peer)
                raise TransferError(f"cannot prepare descriptors for {agent_name}: "
                                    f"{type(e).__name__}: {e}") from e
        return peer

    def disconnect(self, peer: RemoteRank) -> None:
        """Release the peer's descriptor lists and remove its agent. READs on it must be
        over first: NIXL transfers use the lists they were built from."""
        with self._lock:
            if self._peers.pop(id(peer), None) is None:
                return  # already disconnected
            for dl in (peer.remote_dlist, peer.local_dlist, peer.tags_dlist, peer.scratch_dlist):
                if dl is not None:
                    self._agent.release_dlist_handle(dl)
            peer.remote_dlist = peer.local_dlist = peer.tags_dlist = peer.scratch_dlist = None
            if peer.scratch_reg is not None:
                self._agent.deregister_memory(peer.scratch_reg)
                peer.scratch_reg = None
            self._agent.remove_remote_agent(peer.agent_name)

    def _prep_tags(self, peer: RemoteRank) -> None:
        assert self.kv is not None
        remote = np.array([(peer.meta.tags_addr + 8 * i, 8, 0)
                           for i in range(peer.meta.kv.num_blocks)], dtype=np.uint64)
        peer.scratch = np.zeros(self.kv.num_blocks, dtype=np.uint64)
        peer.scratch_reg = self._agent.register_memory(
            [(peer.scratch.ctypes.data, peer.scratch.nbytes, 0, "")], mem_type="DRAM")
        local = np.array([(peer.scratch.ctypes.data + 8 * i, 8, 0)
                          for i in range(self.kv.num_blocks)], dtype=np.uint64)
        peer.tags_dlist = self._agent.prep_xfer_dlist(peer.agent_name, remote, "DRAM")
        peer.scratch_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")

    def read(self, peer: RemoteRank, local_blocks: Sequence[int], remote_blocks: Sequence[int],
             notif: bytes) -> PendingRead:
        """Start a READ of every head slice of ``remote_blocks`` into ``local_blocks``."""
        if len(local_blocks) != len(remote_blocks):
            raise TransferError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} "
                                "remote blocks")
        assert self.kv is not None
        regions = 2 * self.kv.num_layers
        local_idx = np.concatenate([block_indices(local_blocks, self.kv.num_blocks, regions, i)
                                    for i in range(len(peer.slices))])
        remote_idx = np.concatenate([block_indices(remote_blocks, peer.meta.kv.num_blocks,
                                                   regions, i)
                                     for i in range(len(peer.slices))])
        return self._post(peer, peer.local_dlist, local_idx, peer.remote_dlist, remote_idx, notif)

    def read_tags(self, peer: RemoteRank, local_blocks: Sequence[int],
                  remote_blocks: Sequence[int], notif: bytes) -> PendingRead:
        """Start a READ of ``remote_blocks``' tags into our scratch slots of ``local_blocks``
        (see ``tags_read``); ``remote_blocks`` are checked like ``read``'s."""
        assert self.kv is not None
        if len(local_blocks) != len(remote_blocks):
            raise TransferError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} "
                                "remote blocks")
        remote_idx = block_indices(remote_blocks, peer.meta.kv.num_blocks, 1, 0)
        local_idx = block_indices(local_blocks, self.kv.num_blocks, 1, 0)
        return self._post(peer, peer.scratch_dlist, local_idx, peer.tags_dlist, remote_idx, notif)

    @staticmethod
    def tags_read(peer: RemoteRank, local_blocks: Sequence[int]) -> list[int]:
        """The tags a finished ``read_tags`` brought, in the order of ``local_blocks``."""
        assert peer.scratch is not None
        return [int(t) for t in peer.scratch[np.asarray(local_blocks, dtype=np.int64)]]

    def _post(self, peer: RemoteRank, local_dlist: Any, local_idx: np.ndarray,
              remote_dlist: Any, remote_idx: np.ndarray, notif: bytes) -> PendingRead:
        with self._lock:
            if self._closed or peer.remote_dlist is None:
                raise TransferError(f"peer {peer.agent_name} was disconnected")
            try:  # e.g. the remote agent was removed or re-added since the lists were prepared
                handle = self._agent.make_prepped_xfer("READ", local_dlist, local_idx,
                                                       remote_dlist, remote_idx, notif)
            except Exception as e:
                raise TransferError(f"READ from {peer.agent_name} could not be built: "
                                    f"{type(e).__name__}: {e}") from e
            try:  # a dead peer raises here (NIXL_ERR_REMOTE_DISCONNECT) rather than "ERR"
                state = self._agent.transfer(handle)
            except Exception as e:
                state, why = "ERR", f": {type(e).__name__}: {e}"
            else:
                why = ""
            if state == "ERR":
                with contextlib.suppress(Exception):
                    self._agent.release_xfer_handle(handle)
                raise TransferError(f"READ from {peer.agent_name} could not start{why}")
            pending = PendingRead(handle, peer.agent_name)
            self._reads[id(pending)] = pending
        return pending

    def poll(self, pending: PendingRead) -> str:
        """"DONE", "PROC" or "ERR"; the handle is released once the read ended."""
        with self._lock:
            if id(pending) not in self._reads:
                return "ERR"  # aborted or released before
            try:
                state = self._agent.check_xfer_state(pending.handle)
            except Exception:  # NIXL raises on some failures instead of reporting "ERR"
                state = "ERR"
            if state != "PROC":
                self._release(pending)
        return state

    def abort(self, pending: PendingRead) -> bool:
        """Cancel a READ in flight. True when it is over (cancelled, or it had ended) and
        its handle released; False when NIXL could not cancel it yet: poll it until it
        ends, since it may still write into the local blocks."""
        with self._lock:
            if id(pending) not in self._reads:
                return True
            try:
                self._agent.release_xfer_handle(pending.handle)
            except Exception:  # "cannot be cancelled now": the handle stays valid
                return False
            del self._reads[id(pending)]
        return True

    def _release(self, pending: PendingRead) -> None:
        try:
            self._agent.release_xfer_handle(pending.handle)
        finally:
            self._reads.pop(id(pending), None)

    def close(self, timeout: float = 5.0) -> None:
        """Abort READs in flight (waiting up to ``timeout`` for those NIXL cannot cancel),
        disconnect every peer and deregister the KV cache. Idempotent."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            with self._lock:
                for pending in list(self._reads.values()):
                    if not self.abort(pending):
                        self.poll(pending)  # releases it once it has ended
                if not self._reads or time.monotonic() > deadline:
                    break
            time.sleep(0.001)
        with self._lock:
            for peer in list(self._peers.values()):
                try:
                    self.disconnect(peer)
                except Exception:  # a dead peer's agent may be gone already
                    self._peers.pop(id(peer), None)
            if self._reads:
                # A READ NIXL could neither cancel nor finish may still write into the cache:
                # keep the agent, its registration and the tensor alive with the process.
                return
            if self._reg is not None:
                self._agent.deregister_memory(self._reg)
                self._reg = None
            if self._tags_reg is not None:
                self._agent.deregister_memory(self._tags_reg)
                self._tags_reg = None
            self._kv_tensor = None
            # The agent's UCX worker, progress thread, sockets and shared memory go with it.
            self._agent = None

    def wait(self, pending: PendingRead, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.poll(pending)) == "PROC":
            if time.monotonic() > deadline:
                raise TransferError(f"READ from {pending.agent_name} not done in {timeout:g}s")
            time.sleep(0.0002)
        if state != "DONE":
            raise TransferError(f"READ from {pending.agent_name} failed")

    def send_notification(self, peer: RemoteRank, msg: bytes) -> None:
        """A notification to ``peer``'s agent, not bound to a transfer."""
        with self._lock:
            if self._closed or peer.remote_dlist is None:
                raise TransferError(f"peer {peer.agent_name} was disconnected")
            try:
                self._agent.send_notif(peer.agent_name, msg)
            except Exception as e:
                raise TransferError(f"notification to {peer.agent_name} failed: "
                                    f"{type(e).__name__}: {e}") from e

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""
        with self._lock:
            return {} if self._agent is None else self._agent.get_new_notifs()

    def rank_metadata(self, engine_id: str, epoch: str, tp_rank: int, tp_size: int) -> RankMetadata:
        """What peers need to read this rank (served by the side channel)."""
        if self.kv is None:
            raise TransferError("register the KV cache first")
        return RankMetadata(engine_id=engine_id, epoch=epoch, tp_rank=tp_rank, tp_size=tp_size,
                            agent_name=self.name, agent_metadata=self.metadata(), kv=self.kv,
                            tags_addr=int(self.tags.ctypes.data) if self.tags is not None else 0)
