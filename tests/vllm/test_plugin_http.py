"""The plug-in in real vLLM over the http method: mutual TLS and token, P/D with vLLM's
protocol, a refused token, kvbridge's proxy in front of the pair found in etcd, a restarted
prefill. Three vLLM servers for the module: a prefill and a decode registered in a real etcd
(the same record as ``kvbridge serve --registry``), and a decode with the wrong token, stopped
after its test (its memory and core are not needed for the rest)."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.errors import ConfigError
from kvbridge.net import listen_socket
from kvbridge.tools.launch import KVBridgeProcess, free_port, read_metric
from kvbridge.tools.testing.etcd_server import EtcdProcess
from kvbridge.tools.testing.procfs import gone, group_processes, listening, status_field
from kvbridge.tools.vllm.launch import VllmServer, decode, pd_text, prefill
from tests.helpers import wait_until
from tests.vllm.conftest import (
    MAX_TOKENS,
    NO_PREFIX_CACHE,
    PROMPT,
    REQUEST_TIMEOUT,
    answer,
    nixl_bytes,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _token_file(d: Path, name: str, token: str) -> str:
    path = d / name
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return str(path)


def _https(certs: Path, name: str, token_file: str) -> dict[str, str]:
    """One instance's side channel: https, client certificates required, a token."""
    return {"handshake_method": "http", "ssl_certfile": str(certs / f"{name}.pem"),
            "ssl_keyfile": str(certs / f"{name}.key"), "ssl_ca_certs": str(certs / "ca.pem"),
            "ssl_cert_reqs": "required", "token_file": token_file,
            "trusted_side_channels": "127.0.0.1"}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    with EtcdProcess(log_dir=tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("vllm-tokens")
    return {"good": _token_file(d, "token", "side-channel-secret"),
            "bad": _token_file(d, "wrong-token", "not-the-secret")}


@pytest.fixture(scope="module")
def servers(model: Path, certs: Path, etcd: EtcdProcess, tokens: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("vllm-http")

    def registered(role: str, port: int) -> dict[str, str]:
        return {"registry": etcd.url, "role": role, "api_url": f"http://127.0.0.1:{port}"}

    pp, dp = free_port(), free_port()
    p = VllmServer.start(model, name="prefill", core=0, log_dir=d, port=pp,
                         extra_config={**_https(certs, "prefill", tokens["good"]),
                                       **registered("prefill", pp)},
                         extra_args=NO_PREFIX_CACHE)
    # side_channel_port 0: the port bound is the one kv_transfer_params advertise.
    dec = VllmServer.start(model, name="decode", core=1, log_dir=d, port=dp,
                           extra_config={**_https(certs, "decode", tokens["good"]),
                                         "side_channel_port": 0, **registered("decode", dp)},
                           extra_args=NO_PREFIX_CACHE)
    # Not registered: the proxy below must see one prefill and one decode.
    wrong = VllmServer.start(model, name="decode-wrong-token", core=1, log_dir=d,
                             extra_config=_https(certs, "decode", tokens["bad"]),
                             extra_args=NO_PREFIX_CACHE)
    with running(p, dec, wrong):
        yield p, dec, wrong


def _side_channel(certs: Path, *, cert: bool = True) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(certs / "decode.pem"), str(certs / "decode.key"))
    return httpx.Client(verify=ctx, timeout=10.0)


def test_each_workers_forward_stays_on_the_core_it_was_given(servers):
    """vLLM's NIXL worker pins the thread that runs the forward to the machine's last core
    (stock vLLM on CPU: prefill and decode then compute on one core); the plug-in keeps
    the core VLLM_CPU_OMP_THREADS_BIND gave it (kvbridge/vllm/affinity.py)."""
    p, dec, _ = servers
    for server, core in ((p, "0"), (dec, "1")):
        (worker, _), = group_processes(server.proc.pid, "VLLM::Worker")
        allowed = status_field(str(worker), "Cpus_allowed_list")
        assert allowed == core, f"{server.name}'s worker runs on cores {allowed}"


def test_wrong_token_is_refused_fast_and_the_prefill_keeps_serving(servers, certs):
    p, d, wrong = servers
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    start = time.monotonic()
    r = decode(wrong.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    took = time.monotonic() - start
    log = wrong.log_text()
    # vLLM's kv_load_failure_policy "fail": the request ends in an error, not a hang.
    failed = r.status_code != 200 or r.json()["choices"][0].get("finish_reason") == "error"
    assert failed, r.text
    assert took < 120, took  # a busy machine; the refusal itself is immediate (401)
    assert "refused our credentials" in log
    # The prefill still serves.
    assert pd_text(p.url, d.url, PROMPT, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)


def port_free(port: int) -> bool:
    return not listening(port)


def test_the_side_channel_process_dies_with_vllms_engine_core_killed(servers):
    """The side channel runs in a process of its own, a child of vLLM's engine core; the
    engine core killed with SIGKILL, it is gone and its port free. (On the wrong-token
    decode, done with after the test above: its core and memory go to the restart below.)"""
    _, _, wrong = servers
    try:
        (child, core), = group_processes(wrong.proc.pid, "kvbridge.handshake.process.child")
        assert core not in (wrong.proc.pid, child)  # the engine core, not the API server
        port = wrong.side_channel_port
        with pytest.raises(ConfigError, match="already in use"):
            listen_socket("127.0.0.1", port, "the side channel's port")
        os.kill(core, signal.SIGKILL)
        # (a big process takes a moment to die: its sockets close once its memory is gone)
        wait_until(lambda: gone(core) and gone(child), 60,
                   "the side-channel process gone with the engine core")
        wait_until(lambda: port_free(port), 60, "the side channel's port free",
                   message=lambda: subprocess.run(["ss", "-ltnp", f"sport = :{port}"],
                                                  capture_output=True, text=True).stdout)
    finally:
        wrong.stop()


def test_pd_over_mutual_tls_and_token_reads_the_kv_and_answers_the_same(servers, certs):
    p, d, _ = servers
    # The same text computed without any KV transfer: the prefill asked directly.
    expected = answer(p)
    before = nixl_bytes(d)
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    assert params["remote_port"] == p.side_channel_port
    assert params["remote_host"] == "127.0.0.1"
    r = decode(d.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert nixl_bytes(d) > before  # the KV was read over NIXL, not recomputed
    assert f"kvbridge handshake: http 127.0.0.1:{p.side_channel_port}" in d.log_text()


def test_side_channel_serves_readyz_healthz_and_the_json_view_to_verified_peers(servers, certs):
    p, _, _ = servers
    base = f"https://127.0.0.1:{p.side_channel_port}"
    with _side_channel(certs) as c:
        assert c.get(f"{base}/readyz").status_code == 200  # every worker's metadata is in
        assert c.get(f"{base}/healthz").status_code == 200
        assert c.get(f"{base}/v1/kv/handshake").status_code == 401  # no token
        view = c.get(f"{base}/v1/kv/handshake", headers={
            "accept": "application/json",
            "authorization": "Bearer side-channel-secret"}).json()
    assert view["kind"] == "vllm-nixl/NixlHandshakePayload"
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    assert view["engine_id"] == params["remote_engine_id"]
    assert [(r["pp_rank"], r["tp_rank"]) for r in view["ranks"]] == [(0, 0)]
    assert view["ranks"][0]["engine_id"] == params["remote_engine_id"]
    assert "agent_metadata" not in view["ranks"][0]
    with _side_channel(certs, cert=False) as c, pytest.raises(httpx.HTTPError):
        c.get(f"{base}/readyz")  # mutual TLS: no client certificate, no connection


def test_decode_side_channel_port_zero_advertises_the_port_bound(servers, certs):
    _, d, _ = servers  # started with side_channel_port 0
    params = prefill(d.url, PROMPT, REQUEST_TIMEOUT)
    port = params["remote_port"]
    assert isinstance(port, int) and port > 0
    with _side_channel(certs) as c:
        assert c.get(f"https://127.0.0.1:{port}/readyz").status_code == 200


# kvbridge's proxy in front of the pair, both found in etcd: paired by vLLM's own
# compatibility hash, prewarmed (vLLM has no /v1/kv/prewarm: a one-token P/D warm-up request)
# and serving a chat request through prefill -> NIXL READ -> decode.

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BYTES_READ = "vllm:nixl_bytes_transferred_sum"


@pytest.fixture(scope="module")
def read_before_proxy(servers) -> float:
    """The decode's NIXL bytes before the proxy exists (and prewarms the pair)."""
    return nixl_bytes(servers[1])


@pytest.fixture(scope="module")
def proxy(servers, read_before_proxy: float, etcd: EtcdProcess, tokens: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    p = KVBridgeProcess("proxy", tmp_path_factory.mktemp("proxy"), "proxy", "--port", str(port),
                        "--registry", etcd.url, "--kv-token-file", tokens["good"],
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


def test_the_proxy_discovers_both_vllm_instances(proxy, servers) -> None:
    p, d, _ = servers

    def both() -> dict | None:
        fleet = _get(proxy + "/v1/fleet")
        return fleet if fleet["prefill"] and fleet["decode"] else None

    fleet = wait_until(both, 60, "a prefill and a decode in the proxy's view")
    (prefill_row,), (decode_row,) = fleet["prefill"], fleet["decode"]
    assert (prefill_row["url"], decode_row["url"]) == (p.url, d.url)
    assert prefill_row["source"] == decode_row["source"] == "registry"
    # Paired because the hashes match: vLLM's own compatibility hash, published.
    assert prefill_row["compat_hash"] == decode_row["compat_hash"] is not None


def test_prewarm_handshakes_the_pair_with_a_warm_up_request(proxy, servers,
                                                           read_before_proxy) -> None:
    _, d, _ = servers
    status = wait_until(lambda: (s := _get(proxy + "/v1/kv/prewarm"))["pairs"] and s, 300,
                        "a prewarmed pair")
    assert [p["outcome"] for p in status["pairs"]] == ["ok"], status
    with httpx.Client(trust_env=False) as c:  # the warm-up's KV was read over NIXL
        assert read_metric(c, d.url, BYTES_READ) > read_before_proxy


def test_chat_through_the_proxy_answers_like_vllm_alone(proxy, servers) -> None:
    _, d, _ = servers
    body = {"model": "model", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT) as c:
        before = read_metric(c, d.url, BYTES_READ)
        via_proxy = c.post(proxy + "/v1/chat/completions", json=body)
        after = read_metric(c, d.url, BYTES_READ)
        alone = c.post(d.url + "/v1/chat/completions", json=body)
    assert via_proxy.status_code == 200, via_proxy.text
    text = via_proxy.json()["choices"][0]["message"]["content"]
    assert text == alone.json()["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert after > before  # this request's KV was read over NIXL, not recomputed


# Last in the module: the prefill is a new process after it.
def test_restarted_prefill_on_the_same_ports_is_handshaken_again_without_decode_restart(
        servers, certs):
    p, d, _ = servers
    expected = answer(p)
    first = prefill(p.url, PROMPT, REQUEST_TIMEOUT)["remote_engine_id"]
    assert pd_text(p.url, d.url, PROMPT, max_tokens=MAX_TOKENS,
                   timeout=REQUEST_TIMEOUT) == expected
    p.restart()
    p.wait_healthy(900)
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    assert params["remote_engine_id"] != first
    assert params["remote_port"] == p.side_channel_port
    before = nixl_bytes(d)
    r = decode(d.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert nixl_bytes(d) > before
    with _side_channel(certs) as c:
        epoch = c.get(f"https://127.0.0.1:{p.side_channel_port}/v1/kv/handshake", headers={
            "accept": "application/json",
            "authorization": "Bearer side-channel-secret"}).json()["epoch"]
    wait_until(lambda: f"epoch {epoch} (new; was " in d.log_text(), 10,
               "the decode's log names the restarted prefill's new epoch")
