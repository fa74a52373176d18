"""Block tags: what a KV block holds, in 8 bytes a peer can READ next to the block.

Every rank keeps one tag per KV block in NIXL-registered memory. A block's tag is a
hash of the tokens whose KV it holds *and of every token before them* (a chain over the
blocks of the sequence), so it names the block's content and its position in a prompt.
The rank that writes KV into a block clears the block's tag first and sets the new one
once the forward is done; ``0`` means "no known content".

A decode validates a READ with it (optimistic read, then validate): once the READ of
the blocks is done it READs their tags and compares them with the tags of its own
prompt. A tag read *after* the data that still names the expected content proves the
block was not rewritten while it was read (the writer clears the tag before it writes).
Reordered ``remote_block_ids``, another prompt, or blocks released and reused for other
tokens all give other tags: the load fails and the request is recomputed (or refused,
per policy), never answered from the wrong KV. The same tokens written again into the
same block give the same KV, so a match is always the right content.

The hash is not secret and needs no key: it protects against wrong content, not
against a peer that can READ the cache (the side channel's authentication does that).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["NO_TAG", "TagChain", "block_tags"]

NO_TAG = 0
_DIGEST = 16


def _h(prev: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(prev + np.asarray(tokens, dtype="<u4").tobytes(),
                           digest_size=_DIGEST).digest()


def _tag(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") or 1  # 0 is reserved for "no content"


class TagChain:
    """One sequence's block tags, with the chain over its full blocks cached (a decode
    step hashes one block, not the whole prefix)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._full: list[bytes] = []  # chain digest after each full block

    def tag(self, token_ids: Sequence[int], block: int, end: int) -> int:
        """The tag of ``block`` when it holds the KV of ``token_ids[block*bs:end]``."""
        bs = self.block_size
        while len(self._full) < block:
            i = len(self._full)
            self._full.append(_h(self._full[-1] if self._full else b"",
                                 token_ids[i * bs:(i + 1) * bs]))
        prev = self._full[block - 1] if block else b""
        return _tag(_h(prev, token_ids[block * bs:end]))

    def written(self, token_ids: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
        """(block index, tag) of each block that KV for ``token_ids[start:end]`` lands in."""
        bs = self.block_size
        return [(b, self.tag(token_ids, b, min((b + 1) * bs, end)))
                for b in range(start // bs, -(-end // bs))]


def block_tags(token_ids: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """The tags of the blocks that hold the KV of ``token_ids[:num_tokens]``, in order."""
    chain = TagChain(block_size)
    return [t for _, t in chain.written(token_ids, 0, num_tokens)]
