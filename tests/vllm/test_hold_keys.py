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
