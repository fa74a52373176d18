"""Attention over the paged KV cache, in plain PyTorch.

Layout (the contract with ``kvbridge.kv_cache``): one layer's cache is
``[2 (K,V), num_blocks, num_kv_heads, block_size, head_dim]``; token ``t`` of a
sequence lives in block ``block_table[t // block_size]``, slot ``t % block_size``.

A forward pass handles a batch of *chunks*: each chunk is the new tokens of one
sequence, starting at position ``start_pos`` (everything before it is already
in the cache). Prefill, prefill after a cached/transferred prefix, and decode
(one new token) are all the same operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqChunk:
    """The new tokens of one sequence in a forward pass."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass.

    New tokens are flattened to ``T`` rows; attention pads them to
    ``[B, max_new]`` so every sequence attends in one batched matmul.
    """

    slot_blocks: torch.Tensor  # [T] cache block of each new token
    slot_offsets: torch.Tensor  # [T] slot inside that block
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0 (masked out)
    query_positions: torch.Tensor  # [B, max_new], padding rows at position 0
    token_batch: torch.Tensor  # [T] which sequence each new token belongs to
    token_row: torch.Tensor  # [T] its row inside the padded [B, max_new]
    last_token: torch.Tensor  # [B] flat index of each sequence's last new token

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int) -> AttentionMetadata:
        positions, batch, rows, last = [], [], [], []
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("a chunk needs at least one new token")
            if (c.start_pos + n + block_size - 1) // block_size > len(c.block_table):
                raise ValueError(f"block table of {len(c.block_table)} blocks is too short "
                                 f"for {c.start_pos + n} tokens")
            positions.extend(range(c.start_pos, c.start_pos + n))
            batch.extend([i] * n)
            rows.extend(range(n))
            last.append(len(positions) - 1)
        pos = torch.tensor(positions, dtype=torch.long)
        tables = [c.block_table for c in chunks]
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables],
                                    dtype=torch.long)
        token_batch = torch.tensor(batch, dtype=torch.long)
        token_row = torch.tensor(rows, dtype=torch.long)
        query_positions = torch.zeros(len(chunks), max(len(c.token_ids) for c in chunks),
                                      dtype=torch.long)
        query_positions[token_batch, token_row] = pos
        return cls(
            slot_blocks=block_tables[token_batch, pos // block_size],
            slot_offsets=pos % block_size,
            block_tables=block_tables,
            query_positions=query_positions,
            token_batch=token_batch,
            token_row=token_row,
            last_token=torch.tensor(last, dtype=torch.long),
        )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the new tokens' K/V in ``cache``, then attend over each sequence's context.

    ``q``: [T, Hq, D]; ``k``, ``v``: [T, Hkv, D]; ``cache``: one layer,
    [2, num_blocks, Hkv, block_size, D]. Query head ``h`` reads KV head
    ``h // (Hq // Hkv)`` (grouped-query attention). Returns [T, Hq, D].
    """
    k_cache, v_cache = cache[0], cache[1]
    # Advanced indices on dims 0 and 2: the indexed view is [T, Hkv, D], matching k/v.
    k_cache[meta.slot_blocks, :, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v

    num_seqs, max_new = meta.query_positions.shape
    _, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv

    def gather(c: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, 1, max_blocks*block_size, D]
        blocks = c[meta.block_tables]  # [B, max_blocks, Hkv, block_size, D]
        blocks = blocks.permute(0, 2, 1, 3, 4)
        return blocks.reshape(num_seqs, hkv, 1, -1, d)

    keys, values = gather(k_cache), gather(v_cache)
    padded = q.new_zeros(num_seqs, max_new, hq, d)
    padded[meta.token_batch, meta.token_row] = q
    padded = padded.view(num_seqs, max_new, hkv, group, d).permute(0, 2, 3, 1, 4)

    scores = padded @ keys.transpose(-1, -2)  # [B, Hkv, G, max_new, K]
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()  # softmax of half-precision scores loses too much
    scores = scores * scale
    key_pos = torch.arange(keys.shape[3])
    # Causal mask; it also hides block-table padding, since every key beyond a
    # sequence's context sits at a position later than all of its queries.
    visible = key_pos.view(1, 1, -1) <= meta.query_positions.unsqueeze(-1)  # [B, max_new, K]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = probs @ values  # [B, Hkv, G, max_new, D]
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_new, hq, d)
    return out[meta.token_batch, meta.token_row]
