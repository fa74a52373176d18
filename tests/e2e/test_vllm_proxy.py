"""kvbridge's proxy in front of stock vLLM: two real vLLM 0.32 servers with vLLM's own
NixlConnector (no plug-in), on the real SmolLM2 checkpoint.

The proxy's prewarm has no kvbridge route to call on vLLM (``/v1/kv/info`` is a 404
there), so it handshakes each pair with a one-token P/D warm-up request; a client's chat
request then goes prefill -> NIXL READ -> decode and answers as a monolithic vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from kvbridge.launch import KVBridgeProcess, free_port, read_metric
from kvbridge.model.models import prepare
from kvbridge.vllm.launch import VllmServer

# The first test also starts both vLLM servers (minutes on 2 cores): past the suite's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

VLLM_START_TIMEOUT = 900.0  # two vLLM servers on 2 cores: minutes each
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stock_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    model = prepare("smollm2-135m-instruct")
    logs = tmp_path_factory.mktemp("vllm-stock")
    procs = {role: VllmServer.start(model, name=f"stock-{role}", log_dir=logs, core=core,
                                    connector="nixl")
             for core, role in enumerate(("prefill", "decode"))}
    try:
        t0 = time.monotonic()
        for p in procs.values():
            p.wait_healthy(VLLM_START_TIMEOUT - (time.monotonic() - t0))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def proxy(stock_pair: dict[str, VllmServer], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[str]:
    port = free_port()
    p = KVBridgeProcess("proxy", tmp_path_factory.mktemp("proxy"), "proxy", "--port", str(port),
                        "--prefill", stock_pair["prefill"].url,
                        "--decode", stock_pair["decode"].url, log_level="info")
    url = f"http://127.0.0.1:{port}"
    try:
        p.wait_healthy(url + "/health", time.monotonic() + 120)
        yield url
    finally:
        p.stop()


def _prewarm_status(proxy: str) -> dict:
    with httpx.Client(trust_env=False) as c:
        return c.get(proxy + "/v1/kv/prewarm", timeout=10).json()


def test_prewarm_handshakes_a_vllm_pair_with_a_warm_up_request(proxy, stock_pair) -> None:
    deadline = time.monotonic() + 300
    while not (status := _prewarm_status(proxy))["done"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    assert [p["outcome"] for p in status["pairs"]] == ["ok"], status
    # The warm-up's KV crossed over NIXL: the decode read it rather than recomputing.
    with httpx.Client(trust_env=False) as c:
        read = read_metric(c, stock_pair["decode"].url, "vllm:nixl_bytes_transferred_sum")
    assert read > 0


def test_chat_through_the_proxy_answers_like_vllm_alone(proxy, stock_pair) -> None:
    body = {"messages": QUESTION, "max_tokens": 24, "temperature": 0}
    with httpx.Client(trust_env=False, timeout=300) as c:
        name = c.get(stock_pair["decode"].url + "/v1/models").json()["data"][0]["id"]
        before = read_metric(c, stock_pair["decode"].url, "vllm:nixl_bytes_transferred_sum")
        via_proxy = c.post(proxy + "/v1/chat/completions", json={**body, "model": name})
        after = read_metric(c, stock_pair["decode"].url, "vllm:nixl_bytes_transferred_sum")
        alone = c.post(stock_pair["decode"].url + "/v1/chat/completions",
                       json={**body, "model": name})
    assert via_proxy.status_code == 200, via_proxy.text
    text = via_proxy.json()["choices"][0]["message"]["content"]
    assert text == alone.json()["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert after > before  # this request's KV was read over NIXL

