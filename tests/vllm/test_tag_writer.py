"""The plug-in's scheduler side of READ validation (kvbridge.vllm.validation.TagWriter): which
blocks each step of vLLM's scheduler output clears and what tags it sets. vLLM's
``SchedulerOutput`` is stood in for by plain objects with its field names (the real one is
built by vLLM's scheduler; tests/vllm/test_validation.py runs the whole path in real vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

from kvbridge.kv_tags import block_tags
from kvbridge.vllm.validation import TagWriter

BS = 16
PROMPT = list(range(100, 140))  # 40 tokens: blocks of 16, 16 and 8


def _out(new=(), cached=None, scheduled=None, finished=()):
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                       num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached,
                           num_scheduled_tokens=dict(scheduled or {}),
                           finished_req_ids=set(finished))


def _new(req_id="a", blocks=(5, 6, 7), computed=0, prompt=PROMPT):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(list(blocks),),
                           num_computed_tokens=computed)


def _cached(req_id, computed, new_blocks=None, resumed=False):
    return SimpleNamespace(req_ids=[req_id], resumed_req_ids={req_id} if resumed else set(),
                           new_block_ids=[(list(new_blocks),) if new_blocks else None],
                           num_computed_tokens=[computed])


def test_a_whole_prompt_clears_and_tags_each_of_its_blocks():
    step = TagWriter(BS).step(_out([_new()], scheduled={"a": 40}))
    assert step.clear == [5, 6, 7]
    assert step.set == list(zip([5, 6, 7], block_tags(PROMPT, 40, BS), strict=True))


def test_chunked_prefill_tags_a_block_again_when_it_fills():
    w = TagWriter(BS)
    first = w.step(_out([_new(blocks=(5, 6))], scheduled={"a": 20}))
    assert first.clear == [5, 6]
    assert first.set == list(zip([5, 6], block_tags(PROMPT, 20, BS), strict=True))
    second = w.step(_out(cached=_cached("a", 20, new_blocks=[7]), scheduled={"a": 20}))
    assert second.clear == [6, 7]  # block 6 is written again: cleared first
    assert second.set == list(zip([6, 7], block_tags(PROMPT, 40, BS)[1:], strict=True))


def test_generated_tokens_leave_their_block_without_a_tag():
    w = TagWriter(BS)
    w.step(_out([_new()], scheduled={"a": 40}))
    step = w.step(_out(cached=_cached("a", 40), scheduled={"a": 1}))
    assert step.clear == [7] and step.set == []


def test_a_resumed_request_uses_its_new_blocks():
    w = TagWriter(BS)
    w.step(_out([_new()], scheduled={"a": 16}))
    step = w.step(_out(cached=_cached("a", 0, new_blocks=[9, 10, 11], resumed=True),
                       scheduled={"a": 40}))
    assert step.clear == [9, 10, 11]
    assert [t for _, t in step.set] == block_tags(PROMPT, 40, BS)


def test_another_prompt_or_order_gives_other_tags():
    other = list(PROMPT)
    other[3] += 1  # one token differs in the first block: every block's tag differs
    assert all(a != b for a, b in zip(block_tags(PROMPT, 40, BS), block_tags(other, 40, BS),
                                      strict=True))
    w = TagWriter(BS)
    tags = [t for _, t in w.step(_out([_new()], scheduled={"a": 40})).set]
    assert len(set(tags)) == 3  # reordered blocks cannot match


def test_finished_requests_are_forgotten_and_embeddings_only_cleared():
    w = TagWriter(BS)
    w.step(_out([_new()], scheduled={"a": 40}, finished={"a"}))
    assert w.step(_out(cached=_cached("a", 40), scheduled={"a": 1})).clear == []
    step = w.step(_out([_new("e", prompt=None)], scheduled={"e": 40}))
    assert step.clear == [5, 6, 7] and step.set == []
