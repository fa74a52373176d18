"""Push mode's NIXL notes through the plug-in's filter (kvbridge.vllm.holds with
``registrations``, kvbridge.vllm.pushreg): whatever reaches a push worker's agent, what it
passes on is either a note vLLM's ``_get_new_notifs`` parses, or a registration vLLM's
prefill can use whole (``_handle_push_reg_notif``, ``_do_start_push_kv``). No vLLM or NIXL
needed: the filter is pure; the path through real vLLM is tests/vllm/test_push.py."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.vllm.holds import SEP, KeyedAgent
from kvbridge.vllm.pushreg import PUSH_REG_PREFIX, registration
from tests.test_note_filter import _NoAgent, vllm_parse

# No deadline: a loaded 2-core machine (vLLM servers starting) stretches one example.
PROPS = settings(deadline=None, derandomize=True)


def vllm_uses(note: bytes) -> None:
    """What vLLM 0.32-0.34's push prefill reads of a registration, raising alike."""
    reg = msgspec.msgpack.decode(note[len(PUSH_REG_PREFIX):])
    assert isinstance(reg.get("request_id"), str)
    for k in ("decode_engine_id", "decode_host", "decode_port", "decode_tp_size",
              "local_block_ids", "request_id"):
        reg[k]  # noqa: B018 - _do_start_push_kv indexes each
    blocks = reg["local_block_ids"]
    groups = blocks if blocks and isinstance(blocks[0], (list, tuple)) else [blocks]
    assert all(isinstance(b, int) and b >= 0 for g in groups for b in g)
    assert isinstance(reg["decode_port"], int) and isinstance(reg["decode_tp_size"], int)


def as_vllm_sends(**fields: Any) -> dict[str, Any]:
    """A registration as vLLM's push scheduler stages it (update_state_after_alloc)."""
    return {"request_id": "cmpl-r-0-0123abcd", "decode_engine_id": "e-d",
            "decode_host": "127.0.0.1", "decode_port": 5601, "decode_tp_size": 1,
            "local_block_ids": [[4, 5, 6]], "remote_engine_id": "e-p",
            "remote_host": "127.0.0.1", "remote_port": 5600, "remote_tp_size": 1,
            "remote_pp_size": 1, **fields}


def note(reg: Any) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(reg)


def passed(notes: list[bytes], registrations: bool = True) -> tuple[list[bytes], list[str]]:
    why: list[str] = []
    agent = KeyedAgent(_NoAgent({"sender": notes}), why.append, registrations=registrations)
    return agent.get_new_notifs().get("sender", []), why


def check(out: list[bytes]) -> None:
    for n in out:
        if n.startswith(PUSH_REG_PREFIX):
            vllm_uses(n)
        else:
            vllm_parse(n)


values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@PROPS
@given(st.lists(st.binary(max_size=64).map(lambda b: PUSH_REG_PREFIX + b), max_size=6))
def test_whatever_bytes_follow_the_prefix_what_passes_is_usable(notes):
    out, why = passed(notes)
    check(out)
    assert len(out) + len(why) == len(notes)


@PROPS
@given(st.dictionaries(st.sampled_from(sorted(as_vllm_sends())), values, max_size=8),
       st.booleans())
def test_whatever_map_arrives_what_passes_is_usable(fields, whole):
    reg = {**as_vllm_sends(), **fields} if whole else fields
    out, why = passed([note(reg)])
    check(out)
    assert len(out) + len(why) == 1


def test_a_registration_as_vllm_sends_it_passes_unchanged():
    for reg in (as_vllm_sends(), as_vllm_sends(local_block_ids=[1, 2]),
                as_vllm_sends(kvbridge_hold_key="k" * 22)):
        assert passed([note(reg)]) == ([note(reg)], [])
        assert registration(note(reg)) == reg


def test_registrations_vllm_cannot_use_whole_are_dropped_and_counted():
    bad = [note({k: v for k, v in as_vllm_sends().items() if k != "decode_host"}),
           note(as_vllm_sends(decode_port="5601")), note(as_vllm_sends(decode_port=True)),
           note(as_vllm_sends(decode_port=70000)), note(as_vllm_sends(decode_tp_size=0)),
           note(as_vllm_sends(local_block_ids=[[1, -1]])),
           note(as_vllm_sends(local_block_ids=[[1], 2])), note(as_vllm_sends(request_id="")),
           note(as_vllm_sends(kvbridge_hold_key=5)), note([1, 2]), PUSH_REG_PREFIX + b"\xc1"]
    assert passed(bad) == ([], ["malformed"] * len(bad))


def test_a_pull_worker_still_drops_registrations():
    """Only the push worker's filter knows them; vLLM's pull worker would parse one as a
    READ-done note and raise."""
    assert passed([note(as_vllm_sends())], registrations=False) == ([], ["malformed"])


def test_registrations_are_sent_unkeyed_and_write_done_notes_keyed():
    agent = KeyedAgent(_Sent(), lambda why: None, registrations=True)
    agent.send_keys["cmpl-r-0-0123abcd"] = "key"
    agent.send_notif("p", notif_msg=note(as_vllm_sends()))
    agent.make_prepped_xfer("WRITE", 1, [0], 2, [0], notif_msg=b"cmpl-r-0-0123abcd:1")
    assert agent._agent.sent == [note(as_vllm_sends()), f"cmpl-r-0-0123abcd:1{SEP}key".encode()]


class _Sent:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_notif(self, remote_agent: str, notif_msg: bytes) -> None:
        self.sent.append(notif_msg)

    def make_prepped_xfer(self, *args: Any, notif_msg: bytes = b"") -> None:
        self.sent.append(notif_msg)
