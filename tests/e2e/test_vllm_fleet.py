"""kvbridge's proxy in front of vLLM plug-in instances found in the registry.

Two real vLLM 0.32 servers with ``KVBridgeConnector`` (http side channel with a token),
each registering itself in a real etcd (the same record as ``kvbridge serve --registry``);
``kvbridge proxy --registry`` discovers them, pairs them by compatibility hash, prewarms
the pair (vLLM has no ``/v1/kv/prewarm``: a one-token P/D warm-up request), and serves a
chat request through prefill -> NIXL READ -> decode with the text vLLM gives alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from kvbridge.launch import KVBridgeProcess, free_port, read_metric
from kvbridge.model.models import prepare
from kvbridge.testing.etcd import EtcdProcess
from kvbridge.vllm.launch import VllmServer
from tests.helpers import wait_until

# The first test also starts both vLLM servers (minutes on 2 cores): past the suite's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

VLLM_START_TIMEOUT = 900.0
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BYTES_READ = "vllm:nixl_bytes_transferred_sum"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(log_dir=tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory):
    p = tmp_path_factory.mktemp("token") / "token"
    p.write_text(os.urandom(16).hex())
    p.chmod(0o600)
    return p


@pytest.fixture(scope="module")
def instances(etcd: EtcdProcess, token_file, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[dict[str, VllmServer]]:
    model = prepare("smollm2-135m-instruct")
    logs = tmp_path_factory.mktemp("vllm-fleet")
    procs: dict[str, VllmServer] = {}
    try:
        for core, role in enumerate(("prefill", "decode")):
            port = free_port()
            procs[role] = VllmServer.start(
                model, name=f"plugin-{role}", log_dir=logs, core=core, port=port,
                connector="kvbridge",
                # Without a prefix cache the decode's own answer is computed, never read
                # from blocks an earlier P/D request brought over.
                extra_args=["--no-enable-prefix-caching"], extra_config={
                    "handshake_method": "http", "token_file": str(token_file),
                    "registry": etcd.url, "role": role,
                    "api_url": f"http://127.0.0.1:{port}"})
        t0 = time.monotonic()
        for p in procs.values():
            p.wait_healthy(VLLM_START_TIMEOUT - (time.monotonic() - t0))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def proxy(instances, etcd: EtcdProcess, token_file, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[str]:
    port = free_port()
    p = KVBridgeProcess("proxy", tmp_path_factory.mktemp("proxy"), "proxy", "--port", str(port),
                        "--registry", etcd.url, "--kv-token-file", str(token_file),
                        "--admin-routes", "open", log_level="info")
    url = f"http://127.0.0.1:{port}"
    try:
        p.wait_healthy(url + "/health", time.monotonic() + 120)
        yield url
    finally:
        p.stop()


def _get(url: str) -> dict:
    with httpx.Client(trust_env=False) as c:
        return c.get(url, timeout=10).json()


def test_the_proxy_discovers_both_vllm_instances(proxy, instances) -> None:
    def both() -> dict | None:
        fleet = _get(proxy + "/v1/fleet")
        return fleet if fleet["prefill"] and fleet["decode"] else None

    fleet = wait_until(both, 60, "a prefill and a decode in the proxy's view")
    (prefill,), (decode,) = fleet["prefill"], fleet["decode"]
    assert (prefill["url"], decode["url"]) == (instances["prefill"].url, instances["decode"].url)
    assert prefill["source"] == decode["source"] == "registry"
    # Paired because the hashes match: vLLM's own compatibility hash, published.
    assert prefill["compat_hash"] == decode["compat_hash"] is not None


def test_prewarm_handshakes_the_pair_with_a_warm_up_request(proxy, instances) -> None:
    status = wait_until(lambda: (s := _get(proxy + "/v1/kv/prewarm"))["pairs"] and s, 300,
                        "a prewarmed pair")
    assert [p["outcome"] for p in status["pairs"]] == ["ok"], status
    with httpx.Client(trust_env=False) as c:  # the warm-up's KV was read over NIXL
        assert read_metric(c, instances["decode"].url, BYTES_READ) > 0


def test_chat_through_the_proxy_answers_like_vllm_alone(proxy, instances) -> None:
    body = {"model": "model", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    decode = instances["decode"].url
    with httpx.Client(trust_env=False, timeout=300) as c:
        before = read_metric(c, decode, BYTES_READ)
        via_proxy = c.post(proxy + "/v1/chat/completions", json=body)
        after = read_metric(c, decode, BYTES_READ)
        alone = c.post(decode + "/v1/chat/completions", json=body)
    assert via_proxy.status_code == 200, via_proxy.text
    text = via_proxy.json()["choices"][0]["message"]["content"]
    assert text == alone.json()["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert after > before  # this request's KV was read over NIXL, not recomputed
