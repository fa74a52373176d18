"""The wire schema: strict decoding, version and compatibility checks, semantic checks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import (
    CompatibilityError,
    KVBridgeError,
    SchemaVersionError,
    WireFormatError,
)
from kvbridge.metadata import (
    SCHEMA_VERSION,
    Compat,
    KVLayout,
    RankMetadata,
    compat_hash,
    compat_of,
    decode_envelope,
    decode_rank,
    encode_envelope,
    encode_rank,
)
from tests.helpers import MODEL, compat, layout, rank_meta

pack = msgspec.msgpack.encode


def _envelope_dict(ranks: list[RankMetadata], c: Compat | None = None) -> dict:
    c = c or compat()
    return {"schema_version": SCHEMA_VERSION, "compat_hash": compat_hash(c),
            "compat": msgspec.to_builtins(c), "body": pack(ranks)}


def _rank_dict(r: RankMetadata) -> dict:
    return msgspec.to_builtins(r) | {"agent_metadata": r.agent_metadata}


# --- round trips ----------------------------------------------------------------------------

def test_envelope_round_trip():
    ranks = [rank_meta(0), rank_meta(1)]
    c = compat()
    out = decode_envelope(encode_envelope(c, ranks), c)
    assert out == ranks
    assert out[1].agent_metadata == ranks[1].agent_metadata
    assert out[0].kv.base_addrs == ranks[0].kv.base_addrs


def test_round_trip_without_expected_compat():
    ranks = [rank_meta(0, 1)]
    assert decode_envelope(encode_envelope(compat(), ranks), None) == ranks


def test_rank_round_trip():
    r = rank_meta(1, agent_metadata=bytes(range(256)))
    assert decode_rank(encode_rank(r)) == r


# --- strict decoding ------------------------------------------------------------------------

def test_unknown_field_in_rank():
    d = _rank_dict(rank_meta(0)) | {"surprise": 1}
    with pytest.raises(WireFormatError, match="surprise"):
        decode_rank(pack(d))


def test_unknown_field_in_body():
    d = _rank_dict(rank_meta(0)) | {"surprise": 1}
    env = _envelope_dict([]) | {"body": pack([d])}
    with pytest.raises(WireFormatError, match=r"body.*surprise"):
        decode_envelope(pack(env), compat())


def test_unknown_field_in_nested_kv_layout():
    d = _rank_dict(rank_meta(0))
    d["kv"] = d["kv"] | {"strides": [1, 2]}
    with pytest.raises(WireFormatError, match="strides"):
        decode_rank(pack(d))


def test_missing_field():
    d = _rank_dict(rank_meta(0))
    del d["agent_name"]
    with pytest.raises(WireFormatError, match="missing required field `agent_name`"):
        decode_rank(pack(d))


def test_missing_field_in_envelope():
    env = _envelope_dict([rank_meta(0)])
    del env["compat_hash"]
    with pytest.raises(WireFormatError, match=r"envelope.*compat_hash"):
        decode_envelope(pack(env), compat())


def test_wrong_type():
    d = _rank_dict(rank_meta(0))
    d["tp_rank"] = "0"
    with pytest.raises(WireFormatError, match=r"Expected `int`, got `str`.*tp_rank"):
        decode_rank(pack(d))


def test_wrong_type_nested():
    d = _rank_dict(rank_meta(0))
    d["kv"] = d["kv"] | {"base_addrs": [1, "2"]}
    with pytest.raises(WireFormatError, match=r"base_addrs"):
        decode_rank(pack(d))


def test_not_msgpack():
    with pytest.raises(WireFormatError, match="malformed"):
        decode_envelope(b"\xc1\xc1\xc1", compat())


def test_error_messages_are_clear_and_not_chained():
    d = _rank_dict(rank_meta(0))
    d["epoch"] = 7
    with pytest.raises(WireFormatError) as ei:
        decode_rank(pack(d))
    assert "invalid rank metadata" in str(ei.value) and "epoch" in str(ei.value)
    assert ei.value.__cause__ is None and ei.value.__suppress_context__


def test_oversized_message():
    data = encode_envelope(compat(), [rank_meta(0, 1)])
    assert decode_envelope(data, compat(), max_bytes=len(data))
    with pytest.raises(WireFormatError, match=f"{len(data)} bytes exceeds the limit of "
                                              f"{len(data) - 1}"):
        decode_envelope(data, compat(), max_bytes=len(data) - 1)


def test_oversized_checked_before_decoding():
    with pytest.raises(WireFormatError, match="exceeds the limit"):
        decode_envelope(b"\xc1" * 101, compat(), max_bytes=100)


# --- version and compatibility ---------------------------------------------------------------

def test_schema_version_mismatch():
    env = _envelope_dict([rank_meta(0)]) | {"schema_version": SCHEMA_VERSION + 1}
    with pytest.raises(SchemaVersionError, match=f"v{SCHEMA_VERSION + 1}.*v{SCHEMA_VERSION}"):
        decode_envelope(pack(env), compat())


def test_schema_version_checked_before_the_rest_of_the_envelope():
    """A future peer may add envelope fields: it must still be told apart by its version,
    not fail as an unknown field."""
    env = _envelope_dict([rank_meta(0)]) | {"schema_version": SCHEMA_VERSION + 1,
                                             "signature": b"x"}
    del env["compat"]
    with pytest.raises(SchemaVersionError, match=f"v{SCHEMA_VERSION + 1}"):
        decode_envelope(pack(env), compat())


def test_compat_mismatch_names_exactly_the_differing_fields():
    ours = compat(dtype="bfloat16", head_dim=128)
    theirs = compat()
    data = encode_envelope(theirs, [rank_meta(0, 1)])
    with pytest.raises(CompatibilityError) as ei:
        decode_envelope(data, ours)
    err = ei.value
    assert err.fields == {"dtype": ("bfloat16", "float16"), "head_dim": (128, 16)}
    msg = str(err)
    for name in Compat.__struct_fields__:
        assert (f"{name}:" in msg) == (name in err.fields), (name, msg)
    assert "ours='bfloat16' theirs='float16'" in msg
    assert "ours=128 theirs=16" in msg


@pytest.mark.parametrize("field,value", [("model", "other-model"), ("num_layers", 3),
                                         ("layout", "NHD"), ("block_size", 32),
                                         ("total_kv_heads", 8)])
def test_compat_mismatch_single_field(field, value):
    theirs = compat()
    ours = msgspec.structs.replace(theirs, **{field: value})
    with pytest.raises(CompatibilityError) as ei:
        decode_envelope(encode_envelope(theirs, [rank_meta(0, 1)]), ours)
    assert list(ei.value.fields) == [field]


def test_compat_checked_before_body():
    """An incompatible peer fails with CompatibilityError even when its body would not
    decode as ours."""
    theirs = compat(dtype="float32")
    env = _envelope_dict([], theirs) | {"body": b"\xc1 not our body"}
    with pytest.raises(CompatibilityError) as ei:
        decode_envelope(pack(env), compat())
    assert set(ei.value.fields) == {"dtype"}


def test_tampered_compat_hash():
    env = _envelope_dict([rank_meta(0, 1)])
    env["compat"]["dtype"] = "bfloat16"  # hash still of float16
    with pytest.raises(WireFormatError, match="compat_hash does not match"):
        decode_envelope(pack(env), compat())
    env = _envelope_dict([rank_meta(0, 1)]) | {"compat_hash": "0" * 64}
    with pytest.raises(WireFormatError, match="compat_hash does not match"):
        decode_envelope(pack(env), None)


# --- semantic checks --------------------------------------------------------------------------

def _decode_one(r: RankMetadata) -> list[RankMetadata]:
    return decode_envelope(encode_envelope(compat(), [r]), compat())


def test_wrong_number_of_base_addrs():
    r = rank_meta(0, kv=layout(2, base_addrs=[1, 2, 3]))
    with pytest.raises(WireFormatError, match="3 base addresses for 2 layers"):
        _decode_one(r)


@pytest.mark.parametrize("tp_rank,tp_size", [(2, 2), (-1, 2), (0, 0)])
def test_tp_rank_out_of_range(tp_rank, tp_size):
    r = msgspec.structs.replace(rank_meta(0), tp_rank=tp_rank, tp_size=tp_size)
    with pytest.raises(WireFormatError, match=f"tp_rank {tp_rank} outside tp_size {tp_size}"):
        _decode_one(r)


@pytest.mark.parametrize("field,value", [("dtype", "bfloat16"), ("head_dim", 8),
                                         ("num_layers", 1), ("layout", "NHD"),
                                         ("block_size", 8), ("total_kv_heads", 8)])
def test_kv_field_disagreeing_with_envelope(field, value):
    kv = layout(2)
    kv = msgspec.structs.replace(kv, **{field: value})
    if field == "num_layers":  # keep base_addrs consistent so only the disagreement is reported
        kv = msgspec.structs.replace(kv, base_addrs=kv.base_addrs[:2])
    with pytest.raises(WireFormatError, match=f"kv.{field}=.*disagrees with the envelope") as ei:
        _decode_one(rank_meta(0, kv=kv))
    assert str(ei.value).count("disagrees") == 1


@pytest.mark.parametrize("field", ["num_blocks", "block_size", "kv_heads_per_rank", "head_dim"])
def test_non_positive_sizes(field):
    kv = msgspec.structs.replace(layout(2), **{field: 0})
    with pytest.raises(WireFormatError, match="non-positive size field"):
        decode_envelope(encode_envelope(compat_of(MODEL, kv), [rank_meta(0, kv=kv)]), None)


def test_block_len_must_match_the_shape():
    """A peer must not steer descriptors by misreporting its block length."""
    kv = layout(1)  # 4 heads per rank
    kv = msgspec.structs.replace(kv, block_len=kv.block_len + 2)
    with pytest.raises(WireFormatError, match="block_len .* is not heads x block_size"):
        decode_envelope(encode_envelope(compat(), [rank_meta(0, 1, kv=kv)]), compat())


def test_heads_per_rank_must_match_tp_size():
    kv = layout(2)  # 2 heads per rank over tp 2 ...
    with pytest.raises(WireFormatError, match="kv_heads_per_rank 2, expected 4"):
        # ... claimed by a rank of a tp-1 instance, which must hold all 4
        decode_envelope(encode_envelope(compat(), [rank_meta(0, 1, kv=kv)]), compat())


def test_every_problem_reported_together():
    kv = msgspec.structs.replace(layout(2), base_addrs=[1], dtype="int8")
    r = msgspec.structs.replace(rank_meta(0, kv=kv), tp_rank=5)
    with pytest.raises(WireFormatError) as ei:
        _decode_one(r)
    msg = str(ei.value)
    assert "rank 5" in msg and "outside" in msg and "base addresses" in msg and "dtype" in msg


@pytest.mark.parametrize(("total_kv_heads", "tp_size", "per_rank"), [
    (4, 1, 4), (4, 2, 2), (4, 4, 1),
    (2, 4, 1), (1, 8, 1),  # GQA with fewer KV heads than ranks: each rank holds one copy
])
def test_heads_per_rank_for_each_tp_size(total_kv_heads, tp_size, per_rank):
    """Exactly ``per_rank`` heads are accepted; one more or one fewer is refused."""
    c = compat(total_kv_heads=total_kv_heads)

    def rank(heads: int) -> RankMetadata:
        kv = layout(tp_size, total_kv_heads=total_kv_heads, kv_heads_per_rank=heads,
                    block_len=heads * 4 * 16 * 2)  # block_size 4, head_dim 16, float16
        return rank_meta(0, tp_size, kv=kv)

    assert decode_envelope(encode_envelope(c, [rank(per_rank)]), c) == [rank(per_rank)]
    for wrong in (per_rank - 1, per_rank + 1):
        with pytest.raises(WireFormatError, match=f"expected {per_rank}|non-positive"):
            decode_envelope(encode_envelope(c, [rank(wrong)]), c)


# --- the golden wire vector -------------------------------------------------------------------
# Fixed metadata and the exact bytes it is sent as. Reordering, renaming, adding or removing a
# field of the schema changes these bytes (or the compat hash): then bump SCHEMA_VERSION, so a
# peer on the old schema is refused by version instead of misread, and record the new vector.

GOLDEN = Path(__file__).parent / "data" / f"envelope-v{SCHEMA_VERSION}.hex"
# schema version -> compat_hash of the golden Compat
GOLDEN_COMPAT_HASH = {1: "f388ffd792931fc8217605661472e38f70c5995efed6acf51573c23a29849042",
                      2: "ba0d713f01f112dac065d51f4423939cc338b1648a89f46b8ff50bcebb023787"}


def _golden_rank() -> tuple[Compat, RankMetadata]:
    kv = KVLayout(num_layers=2, num_blocks=8, block_size=4, total_kv_heads=4,
                  kv_heads_per_rank=2, head_dim=16, dtype="float16", layout="HND",
                  base_addrs=[0x7F00_0000_0000 + i * 0x1_0000 for i in range(4)], block_len=256)
    compat_ = Compat(schema_version=SCHEMA_VERSION, model="golden-model", dtype="float16",
                     total_kv_heads=4, head_dim=16, num_layers=2, layout="HND", block_size=4)
    return compat_, RankMetadata(engine_id="golden-engine", epoch="epoch-1", tp_rank=1,
                                 tp_size=2, agent_name="agent-golden-r1",
                                 agent_metadata=b"NIXLMD\x00\x01\xfe\xff", kv=kv,
                                 tags_addr=0x7E00_0000_0000)


def test_golden_wire_vector():
    compat_, rank = _golden_rank()
    data = encode_envelope(compat_, [rank])
    assert GOLDEN.exists(), (
        f"no golden vector for schema v{SCHEMA_VERSION}: record it in {GOLDEN}:\n"
        + "\n".join(textwrap.wrap(data.hex(), 64)))
    golden = bytes.fromhex(GOLDEN.read_text())
    assert compat_hash(compat_) == GOLDEN_COMPAT_HASH.get(SCHEMA_VERSION), (
        f"the Compat schema changed: bump SCHEMA_VERSION and record {compat_hash(compat_)}")
    assert data == golden, "the wire bytes changed: bump SCHEMA_VERSION and record the new " \
        "vector:\n" + "\n".join(textwrap.wrap(data.hex(), 64))
    # and the recorded bytes still decode to the same metadata
    assert decode_envelope(golden, compat_) == [rank]


# --- fuzzing ----------------------------------------------------------------------------------

def _assert_only_kvbridge_errors(data: bytes) -> None:
    try:
        decode_envelope(data, compat())
    except (WireFormatError, KVBridgeError):
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data):
    _assert_only_kvbridge_errors(data)


_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
            | st.floats() | st.text(max_size=8) | st.binary(max_size=16))
_msgpack_values = _scalars | st.lists(_scalars, max_size=4) | st.dictionaries(
    st.text(max_size=8), _scalars, max_size=3)


def _int_or_junk():
    return st.integers(min_value=-(2**63), max_value=2**64 - 1) | _msgpack_values


@st.composite
def _near_valid_envelopes(draw) -> bytes:
    """Well-formed envelopes (so decoding reaches the body and the semantic checks) with
    fields of the ranks drawn wild."""
    good = _rank_dict(rank_meta(0, 1))
    ranks = []
    for _ in range(draw(st.integers(0, 3))):
        r = dict(good)
        kv = dict(good["kv"])
        for k in draw(st.sets(st.sampled_from(sorted(kv)))):
            kv[k] = draw(_int_or_junk())
        for k in draw(st.sets(st.sampled_from(sorted(r)))):
            r[k] = draw(_int_or_junk())
        if draw(st.booleans()):
            r["kv"] = kv
        ranks.append(r)
    body = pack(ranks) if draw(st.booleans()) else draw(st.binary(max_size=64))
    env = _envelope_dict([]) | {"body": body}
    if draw(st.booleans()):
        env[draw(st.sampled_from(sorted(env)))] = draw(_msgpack_values)
    return pack(env)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_near_valid_envelopes())
def test_near_valid_envelopes(data):
    _assert_only_kvbridge_errors(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256), st.integers(0, 200))
def test_bytes_appended_to_a_valid_envelope(junk, cut):
    data = encode_envelope(compat(), [rank_meta(0, 1)])
    _assert_only_kvbridge_errors(data[:cut] + junk)
