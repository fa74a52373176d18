"""The paged KV cache: its shape, allocation and the layout description peers read
(no NIXL here: an engine allocates its cache, the data plane registers it)."""

from __future__ import annotations

import torch

from kvbridge.errors import TransferError
from kvbridge.metadata import KVLayout


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
