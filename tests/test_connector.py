"""The connector's scheduler side: per-worker aggregation (including workers that report
nothing), holds, leases, and which kv_transfer_params reach the workers."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.config import SideChannelConfig
from kvbridge.connector.aggregator import LoadAggregator, SendAggregator
from kvbridge.connector.messages import WorkerOutput, decode_notif, encode_notif
from kvbridge.connector.scheduler_side import NixlSchedulerConnector, lease_margin
from kvbridge.errors import InvalidKVTransferParams
from kvbridge.kv_tags import block_tags
from kvbridge.params import KVTransferParams
from kvbridge.tp_mapping import consumers, remote_ranks


def test_load_done_only_when_every_worker_reported():
    agg = LoadAggregator(tp_size=3)
    agg.expect("a")
    assert agg.fold(["a"], {}) == {}
    assert agg.fold([], {}) == {}          # a worker with nothing to say
    assert agg.fold(["a"], {}) == {}
    assert agg.fold(["a"], {}) == {"a": None}
    assert len(agg) == 0


def test_load_first_error_wins_and_unknown_ids_are_ignored():
    agg = LoadAggregator(tp_size=2)
    agg.expect("a")
    assert agg.fold(["zzz"], {"a": "rank 0: boom"}) == {}
    assert agg.fold([], {"a": "rank 1: later"}) == {"a": "rank 0: boom"}


def test_forgotten_load_is_not_reported():
    agg = LoadAggregator(tp_size=1)
    agg.expect("a")
    agg.forget("a")
    assert agg.fold(["a"], {}) == {}


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"),
                         [(1, 1, 4), (1, 4, 4), (4, 1, 4), (2, 4, 4), (4, 2, 2), (4, 4, 2)])
def test_send_released_after_exactly_the_consumers(prefill_tp, decode_tp, heads):
    agg = SendAggregator(prefill_tp, heads)
    notes = [(p, ("r", d, decode_tp)) for d in range(decode_tp)
             for p in remote_ranks(d, decode_tp, prefill_tp, heads)]
    for i, (p, note) in enumerate(notes):
        done = agg.fold(p, [note], held={"r"})
        assert done == ({"r"} if i == len(notes) - 1 else set()), (i, note)
    # every prefill rank with consumers was named, and nothing else
    assert {p for p, _ in notes} == {p for p in range(prefill_tp)
                                     if consumers(p, prefill_tp, decode_tp, heads)}


def test_send_ignores_requests_not_held():
    agg = SendAggregator(1, 4)
    assert agg.fold(0, [("gone", 0, 1)], held=set()) == set()


def test_notif_round_trip_and_garbage():
    assert decode_notif(encode_notif("req|with|bars", 3, 4, None)) == ("req|with|bars", 3, 4,
                                                                         None)
    assert decode_notif(encode_notif("r|k1", -1, 0, "0123")) == ("r|k1", -1, 0, "0123")
    assert decode_notif(b"not ours") is None
    assert decode_notif(b"\xff\xfe|x|y") is None


def _connector(tp: int) -> NixlSchedulerConnector:
    return NixlSchedulerConnector(engine_id="e", epoch="ep", tp_size=tp, total_kv_heads=4,
                                  block_size=16, block_bytes=1024,
                                  side_channel=SideChannelConfig(), lease_seconds=60)


def P(**fields) -> KVTransferParams:  # noqa: N802 - reads like the JSON it stands for
    return KVTransferParams.from_obj(fields)


def test_scheduler_update_tolerates_workers_with_no_output():
    """The seed's fix: a step where some workers return None must not break anything."""
    c = _connector(2)
    assert c.num_remote_tokens("d", [1, 2, 3], P(
        do_remote_prefill=True, remote_block_ids=[7], remote_engine_id="p",
        remote_host="127.0.0.1", remote_port=1, tp_size=1)) == 3
    c.on_blocks_allocated("d", [0])
    assert [s.request_id for s in c.build_worker_meta().loads] == ["d"]
    assert c.update([None, None]).loaded == {}
    assert c.update([WorkerOutput(0, loaded=["d"]), None]).loaded == {}
    assert c.update([None, WorkerOutput(1, loaded=["d"])]).loaded == {"d": None}


def test_scheduler_holds_then_releases_on_notifications():
    c = _connector(2)
    hold, params = c.on_finished("p", [3, 4], P(do_remote_decode=True), 20)
    assert hold and params.remote_block_ids == [3, 4] and params.tp_size == 2
    assert params.do_remote_prefill is True and params.remote_request_id == "p"
    assert params.remote_num_tokens == 20 and params.remote_lease_ms == 60_000
    key = params.remote_hold_key
    assert key and len(key) == 32
    # decode TP 1 reads both prefill ranks: released after both notified
    assert c.update([WorkerOutput(0, notified=[("p", 0, 1, key)]), None]).released == set()
    assert c.update([None, WorkerOutput(1, notified=[("p", 0, 1, key)])]).released == {"p"}
    assert c.num_held == 0


@pytest.mark.parametrize("key", [None, "0" * 32, "short"])
def test_notes_without_the_hold_key_are_ignored_and_counted(key):
    c = _connector(1)
    _, params = c.on_finished("p", [3], P(do_remote_decode=True), 10)
    assert c.update([WorkerOutput(0, notified=[("p", 0, 1, key)])]).released == set()
    assert c.update([WorkerOutput(0, notified=[("p", -1, 0, key)])]).released == set()
    assert not c.release("p", key)
    assert c.num_held == 1
    assert c.metrics.value("kvbridge_kv_notes_ignored_total", {"why": "bad_key"}) == 3
    # the decode that holds the key reads it, and the hold goes
    assert c.update([WorkerOutput(0, notified=[("p", 0, 1, params.remote_hold_key)])]
                    ).released == {"p"}


def test_a_load_carries_the_hold_key_and_the_prompt_tags():
    c = _connector(1)
    prompt = list(range(40))
    c.num_remote_tokens("d", prompt, _remote(remote_block_ids=[7, 8, 9], remote_hold_key="k"))
    c.on_blocks_allocated("d", [0, 1, 2])
    (spec,) = c.build_worker_meta().loads
    assert spec.hold_key == "k" and spec.expected_tags == block_tags(prompt, 40, 16)
    assert len(set(spec.expected_tags)) == 3 and 0 not in spec.expected_tags


def test_scheduler_lease_expiry_releases():
    c = NixlSchedulerConnector(engine_id="e", epoch="ep", tp_size=1, total_kv_heads=4,
                               block_size=16, block_bytes=1, side_channel=SideChannelConfig(),
                               lease_seconds=0)
    c.on_finished("p", [1], P(do_remote_decode=True), 3)
    assert c.update([None]).released == {"p"}
    assert c.metrics.value("kvbridge_held_requests_released_total",
                           {"why": "lease_expired"}) == 1


def test_request_without_remote_decode_is_not_held():
    c = _connector(1)
    assert c.on_finished("x", [1, 2], None, 20) == (False, None)
    assert c.on_finished("y", [1, 2], P(do_remote_decode=False), 20) == (False, None)


def test_an_http_instance_refuses_to_be_talked_down_to_zmq():
    c = NixlSchedulerConnector(engine_id="e", epoch="ep", tp_size=1, total_kv_heads=4,
                               block_size=16, block_bytes=1, side_channel=SideChannelConfig(
                                   handshake_method="http"))
    params = P(do_remote_prefill=True, remote_block_ids=[1], remote_engine_id="p",
               remote_host="127.0.0.1", remote_port=5600, tp_size=1, handshake_method="zmq")
    c.num_remote_tokens("d", [1, 2], params)
    c.on_blocks_allocated("d", [0])
    assert c.build_worker_meta().loads == []  # nothing reaches the workers
    (err,) = c.update([None]).loaded.values()
    assert err.request_fault and "refuses zmq" in err.message
    # the other way round is an upgrade, and fine
    z = _connector(1)
    z.num_remote_tokens("d", [1, 2], msgspec.structs.replace(params, handshake_method="http"))
    z.on_blocks_allocated("d", [0])
    assert [s.method for s in z.build_worker_meta().loads] == ["http"]


def _remote(**extra) -> KVTransferParams:
    return P(do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1",
             remote_port=5600, tp_size=1, **extra)


@pytest.mark.parametrize("blocks, num_tokens, loaded, read", [
    ([7, 8, 9], None, 40, 3),   # whole prompt (last block partial)
    ([7], None, 16, 1),         # one block kept: the rest is computed here
    ([7, 8], None, 32, 2),      # last block missing
    ([7, 8, 9], 20, 20, 2),     # the prefill computed fewer tokens than the blocks hold
])
def test_only_tokens_a_read_covers_count_as_loaded(blocks, num_tokens, loaded, read):
    c = _connector(1)
    prompt = list(range(40))
    params = _remote(remote_block_ids=blocks, remote_num_tokens=num_tokens)
    assert c.num_remote_tokens("d", prompt, params) == loaded
    c.on_blocks_allocated("d", [0, 1, 2])
    (spec,) = c.build_worker_meta().loads
    assert spec.local_block_ids == [0, 1, 2][:read] and spec.remote_block_ids == blocks[:read]


@pytest.mark.parametrize("blocks, num_tokens, why", [
    ([1, 2, 3, 4], None, "needs at most 3"),       # more blocks than the prompt needs
    ([1, 2, 3], 41, "remote_num_tokens"),          # more tokens than the prompt has
    ([1], 20, "hold at most 16"),                  # tokens the blocks cannot hold
])
def test_params_for_another_prompt_are_refused(blocks, num_tokens, why):
    with pytest.raises(InvalidKVTransferParams, match=why):
        _connector(1).num_remote_tokens("d", list(range(40)), _remote(
            remote_block_ids=blocks, remote_num_tokens=num_tokens))


@pytest.mark.parametrize("field, value", [
    ("do_remote_prefill", "false"), ("remote_port", "25600"), ("remote_port", 25600.9),
    ("remote_port", 0), ("remote_block_ids", [1.0]), ("remote_block_ids", [-1]),
    ("tp_size", 0), ("handshake_method", "carrier-pigeon"), ("remote_engine_id", 5),
])
def test_params_are_never_coerced(field, value):
    with pytest.raises(InvalidKVTransferParams, match=field):
        KVTransferParams.from_obj({"do_remote_prefill": True, field: value})


def test_vllm_shapes_are_accepted():
    # the prefill hop of vLLM's proxy: nulls everywhere, and fields we do not know
    hop = KVTransferParams.from_obj({**KVTransferParams.for_prefill(), "future_field": 1})
    assert hop.do_remote_decode and not hop.loads_remote_kv
    # a prefill's answer, passed verbatim (vLLM's NixlConnector fields only)
    answer = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1],
              "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h",
              "remote_port": 5600, "tp_size": 2}
    assert KVTransferParams.from_obj(answer).check().to_json() == answer
    with pytest.raises(InvalidKVTransferParams, match="remote_host"):
        P(do_remote_prefill=True, remote_block_ids=[1], remote_engine_id="p",
          remote_port=5600).check()


def test_a_load_is_fenced_inside_the_prefill_lease():
    c = _connector(1)
    c.num_remote_tokens("d", [1, 2], _remote(remote_block_ids=[1], remote_lease_ms=30_000))
    c.on_blocks_allocated("d", [0])
    (spec,) = c.build_worker_meta().loads
    assert 30 - lease_margin(30) - 1 < spec.fence_seconds <= 30 - lease_margin(30)


def test_release_frees_a_hold_at_the_next_update():
    c = _connector(1)
    _, params = c.on_finished("p", [3, 4], P(do_remote_decode=True), 20)
    key = params.remote_hold_key
    assert c.release("p", key) and not c.release("unknown", key)
    assert c.update([None]).released == {"p"}
    assert not c.release("p", key)  # gone already
    assert c.metrics.value("kvbridge_held_requests_released_total", {"why": "abandoned"}) == 1
