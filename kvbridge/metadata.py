"""The wire schema of the handshake: per-rank metadata inside a versioned envelope.

Decoding is two-phase (as in vLLM): the small ``Envelope`` is decoded first and
its schema version and compatibility hash are checked *before* the body is
touched, so an incompatible peer fails with an error naming what differs rather
than a decode error deep inside the body. All decoding is strict: unknown or
missing fields and wrong types are errors, and sizes are bounded.

See docs/protocol.md for the field-by-field description.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

from kvbridge.errors import CompatibilityError, SchemaVersionError, WireFormatError

SCHEMA_VERSION = 2  # 2: RankMetadata.tags_addr (block tags, see kvbridge.kv_tags)
DTYPE_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class KVLayout(_Strict):
    """Where one rank's KV cache lives and how it is shaped.

    The cache is ``num_layers * 2`` regions (layer-major, K then V); each region
    holds ``num_blocks`` blocks of ``block_len`` bytes at ``base_addrs[region]``.
    Inside a block, heads are outermost (layout ``HND``) so a head range is
    contiguous: head ``h`` starts at ``h * block_size * head_dim * itemsize``.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    total_kv_heads: int
    kv_heads_per_rank: int
    head_dim: int
    dtype: str
    layout: str
    base_addrs: list[int]
    block_len: int

    @property
    def head_len(self) -> int:
        """Bytes of one head inside one block."""
        return self.block_len // self.kv_heads_per_rank


class RankMetadata(_Strict):
    """What a peer needs to READ one rank's KV blocks."""

    engine_id: str
    epoch: str
    tp_rank: int
    tp_size: int
    agent_name: str
    agent_metadata: bytes
    kv: KVLayout
    # Address of the rank's block tags: ``kv.num_blocks`` little-endian uint64s, one per
    # block, in the registered memory of ``agent_metadata`` (see kvbridge.kv_tags).
    tags_addr: int


class Compat(_Strict):
    """The fields that must be equal on both sides; hashed into ``compat_hash``."""

    schema_version: int
    model: str
    dtype: str
    total_kv_heads: int
    head_dim: int
    num_layers: int
    layout: str
    block_size: int


class Envelope(_Strict):
    """The outer message: checked before ``body`` (msgpack of ``list[RankMetadata]``)."""

    schema_version: int
    compat_hash: str
    compat: Compat
    body: bytes


class _Version(msgspec.Struct):
    """Only the envelope's schema version, read leniently: a peer speaking another
    version (other or more fields) is told apart by its version, not by a decode error."""

    schema_version: int


def compat_hash(compat: Compat) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(compat)).hexdigest()


def compat_of(model: str, kv: KVLayout) -> Compat:
    return Compat(schema_version=SCHEMA_VERSION, model=model, dtype=kv.dtype,
                  total_kv_heads=kv.total_kv_heads, head_dim=kv.head_dim,
                  num_layers=kv.num_layers, layout=kv.layout, block_size=kv.block_size)


_version_decoder = msgspec.msgpack.Decoder(_Version)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_ranks_decoder = msgspec.msgpack.Decoder(list[RankMetadata])
_rank_decoder = msgspec.msgpack.Decoder(RankMetadata)
_encoder = msgspec.msgpack.Encoder()


def encode_rank(meta: RankMetadata) -> bytes:
    return _encoder.encode(meta)


def decode_rank(data: bytes) -> RankMetadata:
    """Decode one worker's metadata (as the head process gathers it)."""
    try:
        return _rank_decoder.decode(data)
    except msgspec.ValidationError as e:
        raise WireFormatError(f"invalid rank metadata: {e}") from None
    except msgspec.DecodeError as e:
        raise WireFormatError(f"malformed rank metadata: {e}") from None


def encode_envelope(compat: Compat, ranks: list[RankMetadata]) -> bytes:
    return _encoder.encode(Envelope(schema_version=SCHEMA_VERSION, compat_hash=compat_hash(compat),
                                    compat=compat, body=_encoder.encode(ranks)))


def decode_envelope(data: bytes, expected: Compat | None,
                    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[RankMetadata]:
    """Check size, schema version and compatibility, then decode the ranks.

    ``expected`` None skips the compatibility check (tools that only inspect).
    """
    if len(data) > max_bytes:
        raise WireFormatError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    version = _decode(_version_decoder, data, "envelope").schema_version
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"peer speaks wire schema v{version}, we speak v{SCHEMA_VERSION}")
    env = _decode(_envelope_decoder, data, "envelope")
    if env.compat_hash != compat_hash(env.compat):
        raise WireFormatError("envelope compat_hash does not match its compat fields")
    if expected is not None and env.compat_hash != compat_hash(expected):
        raise CompatibilityError(diff_compat(expected, env.compat))
    ranks = _decode(_ranks_decoder, env.body, "body")
    for r in ranks:
        _check_rank(r, env.compat)
    return ranks


def diff_compat(ours: Compat, theirs: Compat) -> dict[str, tuple[Any, Any]]:
    return {f: (getattr(ours, f), getattr(theirs, f)) for f in ours.__struct_fields__
            if getattr(ours, f) != getattr(theirs, f)}


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        raise WireFormatError(f"invalid handshake {what}: {e}") from None
    except msgspec.DecodeError as e:
        raise WireFormatError(f"malformed handshake {what}: {e}") from None


def _check_rank(r: RankMetadata, compat: Compat) -> None:
    """Semantic checks msgspec's types cannot express; a bad peer must not make us
    build descriptors outside its memory."""
    kv = r.kv
    problems = []
    if not 0 <= r.tp_rank < r.tp_size:
        problems.append(f"tp_rank {r.tp_rank} outside tp_size {r.tp_size}")
    if len(kv.base_addrs) != 2 * kv.num_layers:
        problems.append(f"{len(kv.base_addrs)} base addresses for {kv.num_layers} layers")
    if kv.num_blocks <= 0 or kv.block_size <= 0 or kv.kv_heads_per_rank <= 0 or kv.head_dim <= 0:
        problems.append("non-positive size field")
    else:
        heads = max(1, kv.total_kv_heads // r.tp_size) if r.tp_size > 0 else 0
        if kv.kv_heads_per_rank != heads:
            problems.append(f"kv_heads_per_rank {kv.kv_heads_per_rank}, expected {heads} for "
                            f"{kv.total_kv_heads} heads over tp_size {r.tp_size}")
        itemsize = DTYPE_SIZES.get(kv.dtype)
        if itemsize is None:
            problems.append(f"unknown dtype {kv.dtype!r}")
        elif kv.block_len != kv.kv_heads_per_rank * kv.block_size * kv.head_dim * itemsize:
            problems.append(f"block_len {kv.block_len} is not heads x block_size x head_dim x "
                            f"{itemsize} B")
    for name in ("dtype", "total_kv_heads", "head_dim", "num_layers", "layout", "block_size"):
        if getattr(kv, name) != getattr(compat, name):
            problems.append(f"kv.{name}={getattr(kv, name)!r} disagrees with the envelope")
    if problems:
        raise WireFormatError(f"invalid metadata for rank {r.tp_rank}: " + "; ".join(problems))


def to_jsonable(ranks: list[RankMetadata], compat: Compat) -> dict[str, Any]:
    """The JSON view served to people with curl (bytes as base64 by msgspec)."""
    return msgspec.to_builtins({"schema_version": SCHEMA_VERSION, "compat_hash": compat_hash(compat),
                                "compat": compat, "ranks": ranks})


# -- opaque per-rank payloads ---------------------------------------------------------------
# A second envelope, for engines whose per-rank metadata kvbridge does not model (vLLM's
# ``NixlHandshakePayload``): the side channel carries each rank's bytes unchanged and the
# engine checks them itself. Its first key is ``payload_schema`` (not ``schema_version``), so
# neither kind of envelope can be mistaken for the other. See docs/protocol.md.

PAYLOAD_SCHEMA_VERSION = 2  # 2: RankMetadata.tags_addr (block tags, see kvbridge.kv_tags)


class RankPayload(_Strict):
    """One rank's metadata as its engine encoded it."""

    pp_rank: int
    tp_rank: int
    payload: bytes


class PayloadEnvelope(_Strict):
    """Every (or one) rank's opaque payload, with who serves it and when it was encoded.

    ``clock`` is the serving process's ``time.perf_counter()`` and ``wall`` its
    ``time.time()`` at encoding: a peer estimates the offset between the two processes'
    monotonic clocks from them (vLLM stamps block expiry times with ``perf_counter``).
    """

    payload_schema: int
    kind: str
    engine_id: str
    epoch: str
    clock: float
    wall: float
    ranks: list[RankPayload]


class _PayloadVersion(msgspec.Struct):
    payload_schema: int


_payload_version_decoder = msgspec.msgpack.Decoder(_PayloadVersion)
_payload_envelope_decoder = msgspec.msgpack.Decoder(PayloadEnvelope)


def encode_payload_envelope(env: PayloadEnvelope) -> bytes:
    return _encoder.encode(env)


def decode_payload_envelope(data: bytes, kind: str,
                            max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> PayloadEnvelope:
    """Check size, schema version and kind, then decode; payloads stay opaque."""
    if len(data) > max_bytes:
        raise WireFormatError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    version = _decode(_payload_version_decoder, data, "payload envelope").payload_schema
    if version != PAYLOAD_SCHEMA_VERSION:
        raise SchemaVersionError(f"peer speaks payload schema v{version}, we speak "
                                 f"v{PAYLOAD_SCHEMA_VERSION}")
    env = _decode(_payload_envelope_decoder, data, "payload envelope")
    if env.kind != kind:
        raise WireFormatError(f"peer serves {env.kind!r} metadata, we read {kind!r}")
    if not (math.isfinite(env.clock) and math.isfinite(env.wall)):  # the clock offset's inputs
        raise WireFormatError(f"payload envelope: clock {env.clock!r} or wall {env.wall!r} "
                              "is not a finite number")
    seen = set()
    for r in env.ranks:
        if r.pp_rank < 0 or r.tp_rank < 0 or (r.pp_rank, r.tp_rank) in seen:
            raise WireFormatError(f"invalid or repeated rank (pp {r.pp_rank}, tp {r.tp_rank})")
        seen.add((r.pp_rank, r.tp_rank))
    return env
