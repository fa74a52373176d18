"""Heterogeneous tensor parallelism: which remote ranks a local rank reads, and which heads.

Pure functions, no I/O. The KV-head assignment is shared with the model code:

* ``tp <= H`` (H = total KV heads): rank ``r`` holds heads ``[r*H/tp, (r+1)*H/tp)``.
* ``tp > H`` (GQA, heads replicated): rank ``r`` holds the single head ``r*H // tp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import TPMappingError


@dataclass(frozen=True)
class HeadSlice:
    """Read ``num_heads`` heads starting at ``remote_head`` (index inside the remote rank's
    shard) from ``remote_rank`` into local heads starting at ``local_head``."""

    remote_rank: int
    remote_head: int
    local_head: int
    num_heads: int


def _check(tp: int, total_kv_heads: int) -> None:
    if tp < 1 or total_kv_heads < 1:
        raise TPMappingError(f"tp size {tp} and KV heads {total_kv_heads} must be >= 1")
    if total_kv_heads % tp and tp % total_kv_heads:
        raise TPMappingError(
            f"tp size {tp} and {total_kv_heads} KV heads: one must divide the other")


def heads_per_rank(tp: int, total_kv_heads: int) -> int:
    _check(tp, total_kv_heads)
    return max(1, total_kv_heads // tp)


def rank_heads(rank: int, tp: int, total_kv_heads: int) -> range:
    """Global KV heads held by ``rank`` of a TP group of size ``tp``."""
    _check(tp, total_kv_heads)
    if not 0 <= rank < tp:
        raise TPMappingError(f"rank {rank} outside tp size {tp}")
    if tp <= total_kv_heads:
        n = total_kv_heads // tp
        return range(rank * n, (rank + 1) * n)
    head = rank * total_kv_heads // tp
    return range(head, head + 1)


def _holders(head: int, tp: int, total_kv_heads: int) -> list[int]:
    if tp <= total_kv_heads:
        return [head // (total_kv_heads // tp)]
    per = tp // total_kv_heads
    return list(range(head * per, (head + 1) * per))


def plan_reads(local_rank: int, local_tp: int, remote_tp: int,
               total_kv_heads: int) -> list[HeadSlice]:
    """The reads that fill every local head exactly once.

    Each local head is read once, from one remote rank that holds it; among
    replicas (remote GQA replication) the choice spreads local ranks over them.
    Adjacent heads from the same remote rank are merged into one slice.
    """
    local = rank_heads(local_rank, local_tp, total_kv_heads)
    _check(remote_tp, total_kv_heads)
    slices: list[HeadSlice] = []
    for i, head in enumerate(local):
        holders = _holders(head, remote_tp, total_kv_heads)
        src = holders[local_rank % len(holders)]
        remote_head = head - rank_heads(src, remote_tp, total_kv_heads).start
        last = slices[-1] if slices else None
        if (last is not None and last.remote_rank == src
                and last.remote_head + last.num_heads == remote_head
                and last.local_head + last.num_heads == i):
            slices[-1] = HeadSlice(src, last.remote_head, last.local_head, last.num_heads + 1)
        else:
            slices.append(HeadSlice(src, remote_head, i, 1))
    return slices


def remote_ranks(local_rank: int, local_tp: int, remote_tp: int, total_kv_heads: int) -> list[int]:
    """The only remote ranks ``local_rank`` needs to handshake with."""
    return sorted({s.remote_rank for s in plan_reads(local_rank, local_tp, remote_tp,
                                                     total_kv_heads)})


def consumers(remote_rank: int, remote_tp: int, local_tp: int, total_kv_heads: int) -> list[int]:
    """Local ranks that read from ``remote_rank`` (a prefill waits for each to notify)."""
    _check(local_tp, total_kv_heads)
    rank_heads(remote_rank, remote_tp, total_kv_heads)  # checks remote_tp and the rank
    return [r for r in range(local_tp)
            if remote_rank in remote_ranks(r, local_tp, remote_tp, total_kv_heads)]
