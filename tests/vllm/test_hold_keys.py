"""Hold keys on vLLM's READ-done notes (kvbridge.vllm.holds.KeyedAgent), between real NIXL
agents in this process: the note formats are vLLM's; the whole path in real vLLM is
tests/vllm/test_validation.py::test_a_forged_read_done_note_without_the_holds_key_releases_nothing."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.vllm.holds import KeyedAgent, new_key
from tests.helpers import wait_until

nixl = pytest.importorskip("nixl._api")
_names = itertools.count()


def _agent(prefix: str):
    return nixl.nixl_agent(f"{prefix}-{next(_names)}")


@pytest.fixture
def pair():
    """A prefill's agent (keyed) and a plug-in decode's agent (keyed), connected."""
    ignored: list[str] = []
    prefill = KeyedAgent(_agent("prefill"), ignored.append)
    decode = KeyedAgent(_agent("decode"), lambda why: None)
    name = decode.add_remote_agent(prefill.get_agent_metadata())
    return prefill, decode, name, ignored


def _notes(agent: KeyedAgent, n: int) -> list[bytes]:
    got: list[bytes] = []

    def more() -> bool:
        for msgs in agent.get_new_notifs().values():
            got.extend(msgs)
        return len(got) >= n

    wait_until(more, 10, f"{n} note(s) pass")
    return got


def test_a_keyed_note_reaches_vllm_as_vllms_own(pair):
    prefill, decode, name, ignored = pair
    key = new_key()
    prefill.hold_keys["req-1"] = key
    decode.send_keys["req-1"] = key
    decode.send_notif(name, notif_msg=b"req-1:1")
    assert _notes(prefill, 1) == [b"req-1:1"] and ignored == []


def test_notes_without_the_key_release_nothing_and_are_counted(pair):
    prefill, decode, name, ignored = pair
    prefill.hold_keys["req-1"] = new_key()
    forger = _agent("forger")
    to_prefill = forger.add_remote_agent(prefill.get_agent_metadata())
    forger.send_notif(to_prefill, notif_msg=b"req-1:1")  # vLLM's format, no key
    forger.send_notif(to_prefill, notif_msg=b"req-1:1|kvbridge-key=guessed")
    forger.send_notif(to_prefill, notif_msg=b"HB:req-1")  # a heartbeat only extends
    forger.send_notif(to_prefill, notif_msg=b"other:1")  # a hold given no key: vLLM's
    assert sorted(_notes(prefill, 2)) == [b"HB:req-1", b"other:1"]
    wait_until(lambda: sorted(ignored) == ["bad_key", "no_key"], 10, "both are counted")


def test_a_decode_adds_no_key_to_a_prefill_that_gave_none(pair):
    prefill, decode, name, _ = pair
    decode.send_keys["keyed"] = new_key()
    decode.send_notif(name, notif_msg=b"plain:1")
    decode.send_notif(name, notif_msg=b"HB:keyed")
    assert sorted(_notes(prefill, 2)) == [b"HB:keyed", b"plain:1"]


def _request(rid: str, params: dict):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=1,
                                                  extra_args={"kv_transfer_params": params}),
                   None)


def _step(connector):
    from types import SimpleNamespace

    # vLLM's SchedulerOutput, the fields the pull scheduler's metadata reads (no request
    # scheduled: the requests under test are given to the connector directly).
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                          finished_req_ids=set(),
                          scheduled_cached_reqs=SimpleNamespace(
                              req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                              num_computed_tokens=[]))
    return connector.build_connector_meta(out)


def test_the_workers_know_a_holds_key_from_the_step_that_computes_it():
    """The real scheduler connector: the key a held request's params give out is in the
    metadata of the step that computes it, so no note naming the request ever reaches a
    worker that lacks its key (sent once the request was held, the key left a step in
    which any note naming it freed the blocks)."""
    from vllm.v1.request import RequestStatus

    from tests.vllm.objects import scheduler_connector

    with scheduler_connector({"handshake_method": "http"}) as connector:
        held = _request("held", {"do_remote_decode": True})
        aborted = _request("aborted", {"do_remote_decode": True})
        for r in (held, aborted):
            connector.update_state_after_alloc(r, None, 0)
        meta = _step(connector)  # the step that computes both
        assert set(meta.reqs_in_batch) == {"held", "aborted"}
        keys = meta.kvbridge_hold_keys
        assert set(keys) == {"held", "aborted"} and len(set(keys.values())) == 2

        held.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = connector.request_finished(held, ([4, 5],))
        assert delay and params["kvbridge_hold_key"] == keys["held"]
        aborted.status = RequestStatus.FINISHED_ABORTED
        delay, params = connector.request_finished(aborted, ([6],))
        assert not delay and (params or {}).get("kvbridge_hold_key") is None
        after = _step(connector)
        assert after.kvbridge_hold_keys == {}  # nothing new, nothing given twice
        assert set(after.reqs_to_send) == {"held"} and set(after.reqs_not_processed) == {
            "aborted"}  # the worker drops the aborted one's key with it
