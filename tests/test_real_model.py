"""SmolLM2-135M-Instruct, a real trained Llama: kvbridge's engine gives transformers' answers.

Both run the same prepared float32 checkpoint greedily. The prompts are tokenized the
same way (chat template included), and the generated tokens must be equal. Two float32
implementations may sum in different orders; should that ever flip a token, the test
still passes only if, at the first differing step, transformers' two best logits were
within ``NEAR_TIE`` of each other (a genuine near-tie), and says so. The logits
themselves must agree within ``LOGIT_ATOL`` at every position (observed: < 1e-4 on
logits of magnitude ~40).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers  # the reference (installed with vLLM by make venv)

from kvbridge.engine import EngineConfig, LLMEngine, SamplingParams
from kvbridge.model.tokenizer import HFTokenizer
from tests.real_model import CAPITAL_ANSWER, CAPITAL_QUESTION, smollm2_dir

MAX_TOKENS = 24
LOGIT_ATOL = 2e-3
NEAR_TIE = 1e-2
CASES = {
    "chat-capital": [{"role": "user", "content": CAPITAL_QUESTION}],
    "chat-haiku": [{"role": "user", "content": "Write a haiku about the sea."}],
    "chat-system": [{"role": "system", "content": "You answer in one short sentence."},
                    {"role": "user", "content": "Why is the sky blue?"}],
    "plain-fact": "The capital of Germany is",
    "plain-code": "def fibonacci(n):",
    "plain-digits": "Once upon a time, 3 + 4 =",
}


@pytest.fixture(scope="module")
def path():
    return smollm2_dir()


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # One thread each: on a small, shared machine more only spin against each other.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(path) -> Iterator[LLMEngine]:
    with LLMEngine(EngineConfig(model=str(path), tp_size=1, num_threads=1)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return tok, model.eval()


def _ids(tokenizer, case) -> list[int]:
    prompt = CASES[case]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.encode_chat(prompt)


def _reference_ids(tok, case) -> list[int]:
    prompt = CASES[case]
    if isinstance(prompt, str):
        return tok(prompt)["input_ids"]
    return list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


@pytest.mark.parametrize("case", CASES)
def test_prompts_tokenize_as_in_transformers(engine, reference, case):
    assert isinstance(engine.tokenizer, HFTokenizer)
    assert _ids(engine.tokenizer, case) == _reference_ids(reference[0], case)


def test_the_chat_prompt_is_chatml_from_chat_template_jinja(engine):
    text = engine.tokenizer.apply_chat_template(CASES["chat-capital"])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of "
                    "France?<|im_end|>\n<|im_start|>assistant\n")
    assert len(_ids(engine.tokenizer, "chat-capital")) == 37
    assert engine.tokenizer.eos_token_ids == {engine.tokenizer.token_to_id("<|im_end|>")}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers(engine, reference, case):
    _, model = reference
    ids = _ids(engine.tokenizer, case)
    ours = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS))[0]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=sorted(engine.tokenizer.eos_token_ids))
    ref = out[0, len(ids):].tolist()
    if ours == ref:
        return
    step = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)  # noqa: B905
    with torch.inference_mode():
        logits = model(torch.tensor([ids + ref[:step]])).logits[0, -1]
    top = logits.topk(2)
    gap = (top.values[0] - top.values[1]).item()
    assert {ours[step], ref[step]} == set(top.indices.tolist()) and gap <= NEAR_TIE, (
        f"{case}: token {step} differs (ours {ours[step]}, transformers {ref[step]}) and "
        f"transformers' two best logits are {gap:.2e} apart (> {NEAR_TIE}): a real mismatch")


@pytest.mark.parametrize("case", ["chat-capital", "plain-code"])
def test_logits_agree_with_transformers(engine, reference, case):
    _, model = reference
    ids = _ids(engine.tokenizer, case)
    ours = engine.collective_rpc("score", ids)[0]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=LOGIT_ATOL)


def test_the_chat_answer_is_a_real_answer(engine):
    ids = _ids(engine.tokenizer, "chat-capital")
    out = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert out[-1] in engine.tokenizer.eos_token_ids  # <|im_end|> ended the turn
    assert engine.tokenizer.decode(out) == CAPITAL_ANSWER
