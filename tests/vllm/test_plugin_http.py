"""The plug-in in real vLLM over the http method: mutual TLS and token, P/D with vLLM's
protocol, a refused token, a restarted prefill. Three vLLM servers for the module."""

from __future__ import annotations

import os
import ssl
import time
from pathlib import Path

import httpx
import pytest

from kvbridge.vllm.launch import VllmServer, decode, pd_text, prefill
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
            "ssl_cert_reqs": "required", "token_file": token_file}


@pytest.fixture(scope="module")
def servers(model: Path, certs: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("vllm-http")
    good = _token_file(d, "token", "side-channel-secret")
    bad = _token_file(d, "wrong-token", "not-the-secret")
    p = VllmServer.start(model, name="prefill", core=0, log_dir=d,
                         extra_config=_https(certs, "prefill", good))
    # side_channel_port 0: the port bound is the one kv_transfer_params advertise.
    dec = VllmServer.start(model, name="decode", core=1, log_dir=d,
                           extra_config={**_https(certs, "decode", good),
                                         "side_channel_port": 0},
                           extra_args=NO_PREFIX_CACHE)
    wrong = VllmServer.start(model, name="decode-wrong-token", core=1, log_dir=d,
                             extra_config=_https(certs, "decode", bad),
                             extra_args=NO_PREFIX_CACHE)
    with running(p, dec, wrong):
        yield p, dec, wrong


def _side_channel(certs: Path, *, cert: bool = True) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(certs / "decode.pem"), str(certs / "decode.key"))
    return httpx.Client(verify=ctx, timeout=10.0)


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


def test_wrong_token_is_refused_fast_and_the_prefill_keeps_serving(servers, certs):
    p, d, wrong = servers
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    start = time.monotonic()
    try:
        r = decode(wrong.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
        took = time.monotonic() - start
        log = wrong.log_text()
    finally:
        # Done with it: an idle vLLM CPU worker polls its queue and would keep a core busy
        # for the rest of the module (the restart below).
        wrong.stop()
    # vLLM's kv_load_failure_policy "fail": the request ends in an error, not a hang.
    failed = r.status_code != 200 or r.json()["choices"][0].get("finish_reason") == "error"
    assert failed, r.text
    assert took < 120, took  # a busy machine; the refusal itself is immediate (401)
    assert "refused our credentials" in log
    # The prefill still serves.
    assert pd_text(p.url, d.url, PROMPT, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)


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
