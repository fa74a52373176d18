"""SmolLM2-135M-Instruct served for real: ``kvbridge serve`` processes on the prepared
checkpoint, monolithic and P/D over NIXL in both TP directions its heads allow (9 query
heads, 3 KV heads: TP 1 and 3), directly and through the proxy; every path gives the
same text, and the chat question gets a real answer. Names as vLLM serves them: the
``--model`` argument, or ``--served-model-name``.

Two instances, each ``--role both`` (it prefills for one pair and decodes for the other):
``tp1`` (one worker) and ``tp3`` (three). float32, the checkpoint's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.proxy import build_proxy_app
from kvbridge.server.instance import model_identity
from kvbridge.tools.testing.api_server import BackgroundServer
from tests.e2e.conftest import Serve, start_all
from tests.helpers import wait_until
from tests.real_model import CAPITAL_ANSWER, CAPITAL_QUESTION, smollm2_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 16
PROMPTS = ["The capital of Germany is", "def fibonacci(n):"]
# SmolLM2's KV per token: 30 layers x (K, V) x 3 KV heads x head_dim 64 x 4 bytes.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
BLOCK = 16  # kvbridge serve's default --block-size


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def engines(model_dir, token_file, serve_log_dir) -> Iterator[dict[str, Serve]]:
    common = ("--role", "both", "--model", str(model_dir), "--dtype", "float32",
              "--side-channel-port", "0", "--side-channel-token-file", str(token_file))
    yield from start_all({"tp1": ((*common, "--tp", "1"), None),
                          "tp3": ((*common, "--tp", "3"), None)}, serve_log_dir)


def _chat(url: str, model: str, stream: bool = False) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
            "max_tokens": 24, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=120) as c:
        if not stream:
            r = c.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        parts = []
        with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))
        return "".join(parts)


def _complete(url: str, model: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _loads(e: Serve) -> tuple[float, float, float]:
    return (e.metric('kvbridge_kv_loads_total{outcome="ok"}'),
            e.metric('kvbridge_kv_loads_total{outcome="failed"}'),
            e.metric("kvbridge_kv_bytes_loaded_total"))


@pytest.fixture(scope="module")
def monolithic(engines, model_dir) -> dict[str, str]:
    """Each prompt's answer from the TP-1 instance alone (no KV transfer)."""
    name = str(model_dir)
    ref = {"chat": _chat(engines["tp1"].url, name)}
    ref |= {p: _complete(engines["tp1"].url, name, p) for p in PROMPTS}
    return ref


def test_the_monolithic_answer_is_a_real_one(monolithic, engines, model_dir):
    assert monolithic["chat"] == CAPITAL_ANSWER
    assert monolithic["The capital of Germany is"].startswith(" Berlin")
    # TP 3 alone (its own prefill, three workers' all-reduces) answers the same.
    name = str(model_dir)
    assert _chat(engines["tp3"].url, name, stream=True) == CAPITAL_ANSWER
    assert {p: _complete(engines["tp3"].url, name, p) for p in PROMPTS} == \
        {p: monolithic[p] for p in PROMPTS}


@pytest.mark.parametrize(("prefill", "decode"), [("tp1", "tp3"), ("tp3", "tp1")])
def test_pd_through_the_proxy_gives_the_monolithic_text(engines, monolithic, model_dir,
                                                        prefill, decode):
    p, d = engines[prefill], engines[decode]
    name = str(model_dir)
    before = _loads(d)
    app = build_proxy_app([p.url], [d.url], prewarm=False)
    with BackgroundServer(app) as proxy:
        got = {"chat": _chat(proxy.url, name, stream=True)}
        got |= {q: _complete(proxy.url, name, q) for q in PROMPTS}
    assert got == monolithic
    after = _loads(d)
    # Every request's KV came over NIXL, none was recomputed, and the bytes are the
    # model's: whole blocks of 30 layers x 3 KV heads x 64 x float32 per token.
    assert (after[0] - before[0], after[1] - before[1]) == (len(PROMPTS) + 1, 0)
    assert (after[2] - before[2]) % (KV_BYTES_PER_TOKEN * BLOCK) == 0
    assert after[2] - before[2] >= KV_BYTES_PER_TOKEN * BLOCK * (len(PROMPTS) + 1)
    # The prefill's held blocks are all freed once the READs are notified.
    wait_until(lambda: p.metric("kvbridge_held_requests") == 0, 30, "prefill released all")


def test_models_serves_the_path_given(engines, model_dir):
    name = str(model_dir)
    for e in engines.values():
        [card] = httpx.get(e.url + "/v1/models", timeout=10).json()["data"]
        # The name clients started the server with; the weights' identity behind it.
        assert card["id"] == name and card["root"] == model_identity(name)
    r = httpx.post(engines["tp1"].url + "/v1/completions", timeout=60, json={
        "model": model_identity(name), "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert name in r.json()["error"]["message"]


def test_served_model_name_renames_it(tmp_path, serve_log_dir):
    """Checked on the built-in tiny model's checkpoint: naming does not depend on the weights."""
    from kvbridge.model import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "tiny")
    procs = start_all({"named": (("--model", str(ckpt), "--served-model-name", "my-model",
                                  "--side-channel-port", "0"), None)}, serve_log_dir)
    [e] = next(procs).values()
    try:
        [card] = httpx.get(e.url + "/v1/models", timeout=10).json()["data"]
        assert (card["id"], card["root"]) == ("my-model", model_identity(str(ckpt)))
        assert _complete(e.url, "my-model", "hello")
        r = httpx.post(e.url + "/v1/completions", timeout=60, json={
            "model": str(ckpt), "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404
    finally:
        procs.close()
