"""The NIXL data plane: a KV pool in registered memory, block/head-slice descriptors, READs."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbridge.errors import InvalidBlockIds, TransferError
from kvbridge.metadata import KVLayout, RankMetadata
from kvbridge.tp_mapping import HeadSlice


def kv_cache_shape(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                   head_dim: int) -> tuple[int, ...]:
    """Head-major ("HND") paged layout: a head slice of one block is contiguous.

    Index order: layer, K/V, block, head, token-in-block, dim.
    """
    return (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)


def allocate_kv_cache(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                      head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    # zeros() touches every page now, so the first READ does not pay page faults.
    return torch.zeros(kv_cache_shape(num_layers, num_blocks, num_kv_heads, block_size, head_dim),
                       dtype=dtype)


def _nixl_api():
    # The wheel is published as nixl-cu12 (module nixl_cu12); plain `nixl` on other builds.
    try:
        from nixl_cu12 import _api
    except ImportError:  # pragma: no cover - depends on the installed wheel
        from nixl import _api
    # NIXL logs every agent creation at INFO to stdout, which is our tools' output channel.
    nixl_log = logging.getLogger("nixl")
    for h in nixl_log.handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)
    return _api


# Microseconds NIXL's progress thread sleeps between polls. nixl's Python wrapper
# hard-codes 0, so every agent's thread spins a whole core even when idle; 1 ms costs
# little latency here (READs between processes are driven by the initiator).
PROGRESS_DELAY_US = int(os.environ.get("KVBRIDGE_NIXL_PROGRESS_DELAY_US", "1000"))
_agent_lock = threading.Lock()


def _new_agent(api: Any, name: str) -> Any:
    if PROGRESS_DELAY_US <= 0:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # the wrapper builds one of these and sets pthrDelay = 0 on it
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _agent_lock:  # the swap is process-wide for the length of one construction
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgentConfig = base


DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


def kv_layout(kv_cache: torch.Tensor, total_kv_heads: int) -> KVLayout:
    """Describe a cache of shape ``kv_cache_shape(...)`` for peers."""
    num_layers, two, num_blocks, heads, block_size, head_dim = kv_cache.shape
    if two != 2 or not kv_cache.is_contiguous():
        raise TransferError(f"KV cache must be contiguous with shape {kv_cache_shape.__doc__}")
    return KVLayout(
        num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
        total_kv_heads=total_kv_heads, kv_heads_per_rank=heads, head_dim=head_dim,
        dtype=DTYPE_NAMES[kv_cache.dtype], layout="HND",
        base_addrs=[kv_cache[layer, kv].data_ptr() for layer in range(num_layers) for kv in (0, 1)],
        block_len=kv_cache[0, 0, 0].nbytes)


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


@dataclass
class PendingRead:
    handle: Any
    agent_name: str
    started: float = field(default_factory=time.monotonic)


class NixlAgent:
    """A NIXL agent owning one registered KV cache: the wrapper the rest of kvbridge uses."""

    def __init__(self, name: str | None = None):
        api = _nixl_api()
        self.name = name or f"kvbridge-{uuid.uuid4().hex[:12]}"
        self._agent = _new_agent(api, self.name)
        self._reg = None
        self.kv: KVLayout | None = None
        self._kv_tensor: torch.Tensor | None = None
        # Handshake threads connect peers while the worker thread reads and polls.
        self._lock = threading.RLock()

    def register_kv_cache(self, kv_cache: torch.Tensor, total_kv_heads: int) -> KVLayout:
        """Register the whole cache as one region (one registration key to ship)."""
        self._kv_tensor = kv_cache  # keep the memory alive while registered
        self._reg = self._agent.register_memory(
            [(kv_cache.data_ptr(), kv_cache.nbytes, 0, "")], mem_type="DRAM")
        self.kv = kv_layout(kv_cache, total_kv_heads)
        return self.kv

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
            try:  # NIXL raises its own exception types (bad metadata, unknown agent, ...)
                agent_name = self._agent.add_remote_agent(meta.agent_metadata)
            except Exception as e:
                raise TransferError(f"cannot add remote agent {meta.agent_name!r}: "
                                    f"{type(e).__name__}: {e}") from e
            if isinstance(agent_name, bytes):
                agent_name = agent_name.decode()
            peer = RemoteRank(meta, agent_name, slices)
            try:
                peer.remote_dlist = self._agent.prep_xfer_dlist(agent_name, remote, "DRAM")
                peer.local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
            except Exception as e:
                self.disconnect(peer)
                raise TransferError(f"cannot prepare descriptors for {agent_name}: "
                                    f"{type(e).__name__}: {e}") from e
        return peer

    def disconnect(self, peer: RemoteRank) -> None:
        with self._lock:
            for dl in (peer.remote_dlist, peer.local_dlist):
                if dl is not None:
                    self._agent.release_dlist_handle(dl)
            peer.remote_dlist = peer.local_dlist = None
            self._agent.remove_remote_agent(peer.agent_name)

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
        with self._lock:
            if peer.remote_dlist is None:
                raise TransferError(f"peer {peer.agent_name} was disconnected")
            try:  # e.g. the remote agent was removed or re-added since the lists were prepared
                handle = self._agent.make_prepped_xfer("READ", peer.local_dlist, local_idx,
                                                       peer.remote_dlist, remote_idx, notif)
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
                self._agent.release_xfer_handle(handle)
        if state == "ERR":
            raise TransferError(f"READ from {peer.agent_name} could not start{why}")
        return PendingRead(handle, peer.agent_name)

    def poll(self, pending: PendingRead) -> str:
        """"DONE", "PROC" or "ERR"; the handle is released once the read ended."""
        with self._lock:
            try:
                state = self._agent.check_xfer_state(pending.handle)
            except Exception:  # NIXL raises on some failures instead of reporting "ERR"
                state = "ERR"
            if state != "PROC":
                self._agent.release_xfer_handle(pending.handle)
        return state

    def wait(self, pending: PendingRead, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.poll(pending)) == "PROC":
            if time.monotonic() > deadline:
                raise TransferError(f"READ from {pending.agent_name} not done in {timeout:g}s")
            time.sleep(0.0002)
        if state != "DONE":
            raise TransferError(f"READ from {pending.agent_name} failed")

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""
        with self._lock:
            return self._agent.get_new_notifs()

    def rank_metadata(self, engine_id: str, epoch: str, tp_rank: int, tp_size: int) -> RankMetadata:
        """What peers need to read this rank (served by the side channel)."""
        if self.kv is None:
            raise TransferError("register the KV cache first")
        return RankMetadata(engine_id=engine_id, epoch=epoch, tp_rank=tp_rank, tp_size=tp_size,
                            agent_name=self.name, agent_metadata=self.metadata(), kv=self.kv)
