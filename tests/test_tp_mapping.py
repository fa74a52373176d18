"""Heterogeneous TP: properties of the read plan over every valid combination, and examples."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import TPMappingError
from kvbridge.tp_mapping import (
    HeadSlice,
    consumers,
    heads_per_rank,
    plan_reads,
    rank_heads,
    remote_ranks,
)

HEADS = [1, 2, 4, 8, 16]
TPS = [1, 2, 4, 8, 16, 32]


@st.composite
def combos(draw):
    h = draw(st.sampled_from(HEADS))
    local_tp = draw(st.sampled_from(TPS))
    remote_tp = draw(st.sampled_from(TPS))
    local_rank = draw(st.integers(0, local_tp - 1))
    return h, local_tp, remote_tp, local_rank


@settings(max_examples=400, deadline=None)
@given(combos())
def test_plan_properties(combo):
    h, local_tp, remote_tp, local_rank = combo
    slices = plan_reads(local_rank, local_tp, remote_tp, h)
    local = rank_heads(local_rank, local_tp, h)
    n_local = heads_per_rank(local_tp, h)
    assert len(local) == n_local

    # every local head filled exactly once
    filled = [s.local_head + k for s in slices for k in range(s.num_heads)]
    assert sorted(filled) == list(range(n_local))
    assert len(filled) == len(set(filled))

    for s in slices:
        assert s.num_heads >= 1
        remote = rank_heads(s.remote_rank, remote_tp, h)
        # the slice lies inside the remote rank's shard ...
        assert 0 <= s.remote_head and s.remote_head + s.num_heads <= len(remote)
        for k in range(s.num_heads):
            # ... and maps each global head onto the same global head
            local_global = local.start + s.local_head + k
            remote_global = remote.start + s.remote_head + k
            assert local_global == remote_global
            assert remote_global in remote

    # adjacent reads from the same remote rank are merged
    for a, b in zip(slices, slices[1:], strict=False):
        assert not (a.remote_rank == b.remote_rank and a.remote_head + a.num_heads == b.remote_head
                    and a.local_head + a.num_heads == b.local_head)

    used = {s.remote_rank for s in slices}
    assert remote_ranks(local_rank, local_tp, remote_tp, h) == sorted(used)
    for q in range(remote_tp):
        assert (local_rank in consumers(q, remote_tp, local_tp, h)) == (q in used)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(HEADS), st.sampled_from(TPS), st.sampled_from(TPS))
def test_consumers_cover_the_whole_group(h, local_tp, remote_tp):
    """Every local rank is the consumer of exactly the remote ranks it reads from, and every
    global head is read by every local rank holding it."""
    pairs = {(r, q) for r in range(local_tp) for q in remote_ranks(r, local_tp, remote_tp, h)}
    assert pairs == {(r, q) for q in range(remote_tp) for r in consumers(q, remote_tp, local_tp, h)}
    # every local rank needs someone; all remote heads are read when local holds every head
    assert {r for r, _ in pairs} == set(range(local_tp))
    heads_read = {rank_heads(q, remote_tp, h).start + s.remote_head + k
                  for r in range(local_tp)
                  for s in plan_reads(r, local_tp, remote_tp, h)
                  for q in [s.remote_rank] for k in range(s.num_heads)}
    assert heads_read == set(range(h))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(HEADS), st.sampled_from(TPS), st.sampled_from(TPS))
def test_replicas_are_spread(h, local_tp, remote_tp):
    """Local ranks sharing a head spread their reads evenly over the remote replicas."""
    for head in range(h):
        holders = [r for r in range(local_tp) if head in rank_heads(r, local_tp, h)]
        replicas = [q for q in range(remote_tp) if head in rank_heads(q, remote_tp, h)]
        src = Counter()
        for r in holders:
            local_index = head - rank_heads(r, local_tp, h).start
            (s,) = [s for s in plan_reads(r, local_tp, remote_tp, h)
                    if s.local_head <= local_index < s.local_head + s.num_heads]
            assert s.remote_rank in replicas
            src[s.remote_rank] += 1
        assert len(src) == min(len(holders), len(replicas))
        assert max(src.values()) - min(src.values()) <= 1


@pytest.mark.parametrize("local_tp,remote_tp,h", [(3, 2, 4), (2, 3, 4), (4, 2, 6), (2, 4, 6),
                                                  (0, 1, 4), (1, 0, 4), (1, 1, 0), (-2, 2, 4)])
def test_invalid_combinations(local_tp, remote_tp, h):
    with pytest.raises(TPMappingError):
        plan_reads(0, local_tp, remote_tp, h)
    with pytest.raises(TPMappingError):
        consumers(0, remote_tp, local_tp, h)


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_rank_out_of_range(rank):
    with pytest.raises(TPMappingError, match=f"rank {rank} outside tp size 4"):
        rank_heads(rank, 4, 8)
    with pytest.raises(TPMappingError):
        plan_reads(rank, 4, 2, 8)
    with pytest.raises(TPMappingError):
        consumers(rank, 4, 2, 8)


def test_tp_mapping_error_is_a_value_error():
    with pytest.raises(ValueError, match="one must divide the other"):
        heads_per_rank(3, 8)


def test_rank_heads_examples():
    assert [rank_heads(r, 4, 8) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6),
                                                      range(6, 8)]
    # GQA: 2 heads over 8 ranks, each head on 4 consecutive ranks
    assert [rank_heads(r, 8, 2).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_decode_tp_larger_than_prefill():
    # D=4 > P=2, 8 heads: decode rank 3 holds heads 6,7, both on prefill rank 1 (its heads 2,3)
    assert plan_reads(3, 4, 2, 8) == [HeadSlice(remote_rank=1, remote_head=2, local_head=0,
                                                num_heads=2)]
    assert consumers(1, 2, 4, 8) == [2, 3]


def test_equal_tp():
    assert plan_reads(1, 2, 2, 8) == [HeadSlice(1, 0, 0, 4)]
    assert consumers(1, 2, 2, 8) == [1]


def test_decode_tp_smaller_than_prefill():
    # D=1 < P=4, 8 heads: one read per prefill rank, into consecutive local heads
    assert plan_reads(0, 1, 4, 8) == [HeadSlice(q, 0, 2 * q, 2) for q in range(4)]
    assert remote_ranks(0, 1, 4, 8) == [0, 1, 2, 3]
    assert all(consumers(q, 4, 1, 8) == [0] for q in range(4))


def test_gqa_replication_spread_across_replicas():
    # 2 KV heads, prefill TP 8 (each head on 4 ranks), decode TP 4 (each head on 2 ranks):
    # the two decode ranks sharing a head read it from two different replicas.
    plans = [plan_reads(r, 4, 8, 2) for r in range(4)]
    assert plans == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(1, 0, 0, 1)],
                     [HeadSlice(6, 0, 0, 1)], [HeadSlice(7, 0, 0, 1)]]
    # the other replicas are read by nobody
    assert [consumers(q, 8, 4, 2) for q in range(8)] == [[0], [1], [], [], [], [], [2], [3]]


def test_gqa_local_replicated_remote_sharded():
    # decode TP 8 over 2 heads (replicated), prefill TP 2: four decode ranks per prefill rank
    assert [remote_ranks(r, 8, 2, 2) for r in range(8)] == [[0]] * 4 + [[1]] * 4
    assert consumers(0, 2, 8, 2) == [0, 1, 2, 3]
