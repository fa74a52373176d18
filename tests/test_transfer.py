"""``NixlAgent``'s own checks, made before anything is sent to a peer: one real agent in
this process (the transfers themselves run between processes, test_transfer_e2e.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbridge.errors import TransferError
from kvbridge.kv_cache import allocate_kv_cache
from kvbridge.tp_mapping import HeadSlice
from kvbridge.transfer import NixlAgent
from tests.helpers import BLOCK_SIZE, BLOCKS, HEAD_DIM, HEADS, LAYERS, rank_meta


@pytest.fixture(scope="module")
def agent() -> Iterator[NixlAgent]:
    a = NixlAgent()
    a.register_kv_cache(allocate_kv_cache(LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM,
                                          torch.float32), HEADS)
    yield a
    a.close()


def test_connect_refuses_a_peer_with_another_head_length(agent):
    """A head slice of 4 tokens x 16 dims is 256 B here (float32) but 128 B on a float16
    peer: descriptors built from one for the other would read the wrong bytes."""
    remote = rank_meta(0, 1, dtype="float16")  # same shape, half the bytes per head
    assert remote.kv.head_len * 2 == agent.kv.head_len
    with pytest.raises(TransferError, match=f"remote head length {remote.kv.head_len} B "
                       f"differs from ours {agent.kv.head_len} B"):
        agent.connect(remote, [HeadSlice(remote_rank=0, remote_head=0, local_head=0,
                                         num_heads=HEADS)])


def test_connect_before_registering_is_refused():
    a = NixlAgent()
    try:
        with pytest.raises(TransferError, match="register the KV cache"):
            a.connect(rank_meta(0, 1), [HeadSlice(0, 0, 0, 1)])
    finally:
        a.close()
