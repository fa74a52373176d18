"""The plug-in's NIXL note filter (kvbridge.vllm.holds): whatever bytes reach a prefill's
agent, what it passes on is a note vLLM's ``_get_new_notifs`` parses without raising.
No vLLM or NIXL needed: the filter is pure; the whole path through real vLLM is
tests/releases/test_plugin_on_releases.py::test_a_malformed_note_is_dropped_and_the_prefill_keeps_serving."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.vllm.holds import SEP, KeyedAgent, new_key

# No deadline: a loaded 2-core machine (vLLM servers starting) stretches one example.
PROPS = settings(deadline=None, derandomize=True)


def vllm_parse(note: bytes) -> None:
    """What vLLM 0.32-0.34 do with a note (pull_worker._get_new_notifs), raising alike."""
    msg = note.decode("utf-8")
    if msg.startswith("HB:"):
        msg[3:].split(",")
        return
    req_id, expected_consumers = msg.rsplit(":", 1)
    assert int(expected_consumers) > 0


class _NoAgent:
    """The filter reads no agent state: ``get_new_notifs`` hands it the notes."""

    def __init__(self, notes: dict[str, list[bytes]]):
        self.notes = notes

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return self.notes


def passed(notes: list[bytes], keys: bool = True, held: dict[str, str] | None = None
           ) -> tuple[list[bytes], list[str]]:
    why: list[str] = []
    agent = KeyedAgent(_NoAgent({"sender": notes}), why.append, keys=keys)
    agent.hold_keys.update(held or {})
    return agent.get_new_notifs().get("sender", []), why


@PROPS
@given(st.lists(st.binary(max_size=64), max_size=8), st.booleans())
def test_whatever_arrives_what_passes_parses(notes, keys):
    out, why = passed(notes, keys)
    for note in out:
        vllm_parse(note)
    assert len(out) + len(why) == len(notes)


@PROPS
@given(st.text(max_size=40).filter(lambda s: s != ""), st.integers(1, 10**6))
def test_a_read_done_note_passes_unchanged(req_id, consumers):
    note = f"{req_id}:{consumers}".encode()
    assert passed([note]) == ([note], [])


def test_malformed_notes_are_dropped_and_counted():
    notes = [b"garbage-without-colon", b"x:notanumber", b"x:0", b"\xff:1", b"x:-1",
             b"x:1" + SEP.encode(), b""]
    assert passed(notes) == ([], ["malformed"] * len(notes))
    assert passed(notes, keys=False) == ([], ["malformed"] * len(notes))


def test_keys_are_checked_only_when_on():
    key = new_key()
    keyed = f"r:1{SEP}{key}".encode()
    assert passed([b"r:1", keyed], held={"r": key}) == ([b"r:1"], ["no_key"])
    assert passed([b"r:1", keyed], keys=False, held={"r": key}) == ([b"r:1", b"r:1"], [])
    assert passed([b"HB:r,s"]) == ([b"HB:r,s"], [])
