"""The connector's scheduler side: per-worker aggregation (including workers that report
nothing), holds, leases, and which kv_transfer_params reach the workers."""

from __future__ import annotations

import pytest

from kvbridge.config import SideChannelConfig
from kvbridge.connector.aggregator import LoadAggregator, SendAggregator
from kvbridge.connector.messages import WorkerOutput, decode_notif, encode_notif
from kvbridge.connector.scheduler import NixlSchedulerConnector
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
    assert decode_notif(encode_notif("req|with|bars", 3, 4)) == ("req|with|bars", 3, 4)
    assert decode_notif(b"not ours") is None
    assert decode_notif(b"\xff\xfe|x|y") is None


def _connector(tp: int) -> NixlSchedulerConnector:
    return NixlSchedulerConnector(engine_id="e", epoch="ep", tp_size=tp, total_kv_heads=4,
                                  block_bytes=1024, side_channel=SideChannelConfig(),
                                  lease_seconds=60)


def test_scheduler_update_tolerates_workers_with_no_output():
    """The seed's fix: a step where some workers return None must not break anything."""
    c = _connector(2)
    assert c.num_remote_tokens("d", [1, 2, 3], {
        "do_remote_prefill": True, "remote_block_ids": [7], "remote_engine_id": "p",
        "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}) == 3
    c.on_blocks_allocated("d", [0])
    assert [s.request_id for s in c.build_worker_meta().loads] == ["d"]
    assert c.update([None, None]).loaded == {}
    assert c.update([WorkerOutput(0, loaded=["d"]), None]).loaded == {}
    assert c.update([None, WorkerOutput(1, loaded=["d"])]).loaded == {"d": None}


def test_scheduler_holds_then_releases_on_notifications():
    c = _connector(2)
    hold, params = c.on_finished("p", [3, 4], {"do_remote_decode": True})
    assert hold and params["remote_block_ids"] == [3, 4] and params["tp_size"] == 2
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "p"
    # decode TP 1 reads both prefill ranks: released after both notified
    assert c.update([WorkerOutput(0, notified=[("p", 0, 1)]), None]).released == set()
    assert c.update([None, WorkerOutput(1, notified=[("p", 0, 1)])]).released == {"p"}
    assert c.num_held == 0


def test_scheduler_lease_expiry_releases():
    c = NixlSchedulerConnector(engine_id="e", epoch="ep", tp_size=1, total_kv_heads=4,
                               block_bytes=1, side_channel=SideChannelConfig(), lease_seconds=0)
    c.on_finished("p", [1], {"do_remote_decode": True})
    assert c.update([None]).released == {"p"}
    assert c.metrics.value("kvbridge_held_requests_released_total",
                           {"why": "lease_expired"}) == 1


def test_request_without_remote_decode_is_not_held():
    c = _connector(1)
    assert c.on_finished("x", [1, 2], None) == (False, None)
    assert c.on_finished("y", [1, 2], {"do_remote_decode": False}) == (False, None)


def test_an_http_instance_refuses_to_be_talked_down_to_zmq():
    c = NixlSchedulerConnector(engine_id="e", epoch="ep", tp_size=1, total_kv_heads=4,
                               block_bytes=1, side_channel=SideChannelConfig(
                                   handshake_method="http"))
    params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1,
              "handshake_method": "zmq"}
    c.num_remote_tokens("d", [1, 2], params)
    c.on_blocks_allocated("d", [0])
    assert c.build_worker_meta().loads == []  # nothing reaches the workers
    (err,) = c.update([None]).loaded.values()
    assert err.startswith("invalid kv_transfer_params") and "refuses zmq" in err
    # the other way round is an upgrade, and fine
    z = _connector(1)
    z.num_remote_tokens("d", [1, 2], {**params, "handshake_method": "http"})
    z.on_blocks_allocated("d", [0])
    assert [s.method for s in z.build_worker_meta().loads] == ["http"]
