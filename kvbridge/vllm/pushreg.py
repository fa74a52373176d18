"""The parse check of push mode's registration notes (vLLM's ``NixlPushConnector``).

A push decode tells the prefill where to WRITE with a NIXL note ``b"PUSH_REG:"`` + a msgpack
map: the decode's request id, engine id, side-channel host and port, TP size and its block
ids. vLLM's prefill decodes it on its writer thread and indexes the map's fields wherever it
uses them: a note with a field missing or of another type raises there (vLLM logs it and
continues), after the prefill's finished blocks were already matched to it, so the real
decode's registration then matches nothing and its request is never written. The plug-in
passes vLLM only registrations of the shape vLLM itself sends. No vLLM import here.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's PUSH_REG_NOTIF_PREFIX (v1/nixl/metadata.py; the drift guard watches it).
PUSH_REG_PREFIX = b"PUSH_REG:"
MAX_BLOCK_IDS = 1 << 20  # far above any KV cache's block count; bounds the note's work
# What the prefill reads of it (the decode's remote_* fields are its own bookkeeping).
_STRINGS = ("request_id", "decode_engine_id", "decode_host")


def _int(v: Any, low: int, high: int) -> bool:
    return type(v) is int and low <= v <= high


def _block_ids(v: Any) -> bool:
    """A flat list of block ids or one list per KV cache group (as vLLM sends either)."""
    if not isinstance(v, list):
        return False
    groups = v if v and isinstance(v[0], list) else [v]
    total = 0
    for g in groups:
        if not isinstance(g, list):
            return False
        total += len(g)
        if total > MAX_BLOCK_IDS or not all(_int(b, 0, 2**31 - 1) for b in g):
            return False
    return True


def registration(note: bytes) -> dict[str, Any] | None:
    """The registration a ``PUSH_REG:`` note carries, or None if vLLM's prefill could not
    use it whole."""
    try:
        reg = msgspec.msgpack.decode(note[len(PUSH_REG_PREFIX):])
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
        return None
    if not isinstance(reg, dict):
        return None
    if not all(isinstance(reg.get(k), str) and reg[k] for k in _STRINGS):
        return None
    if not _int(reg.get("decode_tp_size"), 1, 1 << 16) or not _int(reg.get("decode_port"),
                                                                    1, 65535):
        return None
    if not _block_ids(reg.get("local_block_ids")):
        return None
    key = reg.get("kvbridge_hold_key")
    if key is not None and not (isinstance(key, str) and key):
        return None
    return reg
