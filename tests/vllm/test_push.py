"""Push mode in real vLLM: ``KVBridgePushConnector`` (vLLM's NixlPushConnector, the prefill
WRITEs into the blocks the decode registered) with both handshakes over kvbridge's side
channel, https with mutual TLS and a token. Two servers for the module, a push prefill and a
push decode, one core each.

vLLM pairs a push decode's registration with the prefill's request by the request id less
vLLM's random suffix: both hops carry the same ``X-Request-Id`` (as vLLM's P/D proxies do).
vLLM counts the bytes of a push on the side that posts the WRITE, the prefill: the decode's
``vllm:nixl_bytes_transferred`` stays 0 in push mode, stock vLLM's as well."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvbridge.tools.testing.prometheus import labelled_total, parse_samples
from kvbridge.tools.vllm.launch import VllmServer, decode, pd_text, prefill
from tests.helpers import wait_until
from tests.vllm.conftest import MAX_TOKENS, PROMPT, REQUEST_TIMEOUT, answer, nixl_bytes, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TOKEN = "push-side-channel-secret"
LEASE_S = 300  # a held request waits this long for its registration (a busy machine)


def _https(certs: Path, name: str, token_file: Path) -> dict[str, Any]:
    """One instance's side channel: https, client certificates required, a token presented
    only to the side channels listed as trusted."""
    return {"handshake_method": "http", "ssl_certfile": str(certs / f"{name}.pem"),
            "ssl_keyfile": str(certs / f"{name}.key"), "ssl_ca_certs": str(certs / "ca.pem"),
            "ssl_cert_reqs": "required", "token_file": str(token_file),
            "trusted_side_channels": "127.0.0.1"}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("push-token") / "token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def servers(model: Path, certs: Path, token_file: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    d = tmp_path_factory.mktemp("vllm-push")
    p = VllmServer.start(model, name="prefill", connector="kvbridge-push", core=0, log_dir=d,
                         extra_config={**_https(certs, "prefill", token_file),
                                       "kv_lease_duration": LEASE_S},
                         extra_args=["--no-enable-prefix-caching"])
    # side_channel_port 0: the port bound is the one the decode's registrations advertise.
    dec = VllmServer.start(model, name="decode", connector="kvbridge-push", core=1, log_dir=d,
                           extra_config={**_https(certs, "decode", token_file),
                                         "side_channel_port": 0},
                           extra_args=["--no-enable-prefix-caching"])
    with running(p, dec):
        yield p, dec


@pytest.fixture(scope="module")
def monolithic(servers: tuple[VllmServer, VllmServer]) -> str:
    """The decode's own answer, computed without any transfer."""
    return answer(servers[1])


def _ignored(server: VllmServer, why: str) -> float:
    samples = parse_samples(httpx.get(f"{server.url}/metrics", timeout=60).text)
    return labelled_total(samples, "vllm:kvbridge_notes_ignored_total", why=why)


def test_push_pd_over_https_answers_as_the_decode_alone(servers, monolithic):
    p, dec = servers
    written = nixl_bytes(p)
    text = pd_text(p.url, dec.url, PROMPT, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT,
                   request_id="push-https-1")
    assert text == monolithic
    assert nixl_bytes(p) > written  # the prefill WROTE the prompt's KV
    # Both handshakes over kvbridge's https side channel: the decode's to the prefill (to
    # send its registration), the prefill's to the decode (to WRITE).
    assert f"kvbridge handshake: http 127.0.0.1:{p.side_channel_port} " in dec.log_text()
    assert "kvbridge handshake: http 127.0.0.1:" in p.log_text()
    # Again, on the agents both now know: no new handshake, the same answer.
    assert pd_text(p.url, dec.url, PROMPT, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT,
                   request_id="push-https-2") == monolithic


@pytest.fixture(scope="module")
def forger(servers: tuple[VllmServer, VllmServer], certs: Path, token_file: Path
           ) -> tuple[Any, str]:
    """A NIXL agent of the test's own that knows the prefill's rank 0, as a holder of the
    side channel's token and a client certificate does: (the agent, the prefill's agent)."""
    from nixl._api import nixl_agent
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    from kvbridge.handshake.factory import make_client
    from kvbridge.handshake.payloads import fetch_payloads
    from kvbridge.vllm.nixl_payload import PAYLOAD_KIND
    from kvbridge.vllm.settings import load_settings

    p, _ = servers
    sc = load_settings(_https(certs, "decode", token_file), mode="push").side_channel
    client = make_client(sc, None)
    try:
        fetched = fetch_payloads(client, PAYLOAD_KIND, "127.0.0.1", p.side_channel_port,
                                 [(0, 0)])
    finally:
        client.close()
    payload = msgspec.msgpack.decode(fetched.payloads[(0, 0)], type=NixlHandshakePayload)
    meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
    agent = nixl_agent("push-forger")
    return agent, agent.add_remote_agent(meta.agent_metadata)


def _registration(prefill_rid: str, **fields: Any) -> bytes:
    """A registration as vLLM's push decode sends it, naming the prefill's request by its
    id less vLLM's random suffix (as a real decode's does), for blocks of no real decode."""
    base = prefill_rid.rsplit("-", 1)[0]
    reg = {"request_id": f"{base}-0badf00d", "decode_engine_id": "push-forger",
           "decode_host": "127.0.0.1", "decode_port": 9, "decode_tp_size": 1,
           "local_block_ids": [[0, 1]], "remote_engine_id": "x", "remote_host": "127.0.0.1",
           "remote_port": 9, "remote_tp_size": 1, "remote_pp_size": 1, **fields}
    return b"PUSH_REG:" + msgspec.msgpack.encode(reg)


def test_malformed_notes_are_dropped_and_the_held_request_is_still_written(
        servers, forger, monolithic):
    """A note vLLM cannot parse (its engine step would raise on it) and registrations vLLM's
    writer cannot use whole (one naming the held request, missing the decode's fields: stock
    vLLM matches it, fails on it, and never writes the request) are dropped and counted."""
    p, dec = servers
    agent, prefill_agent = forger
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT, request_id="push-malformed")
    before = _ignored(p, "malformed")
    bad = [b"x:notanumber", b"PUSH_REG:\xc1",
           b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": params["remote_request_id"]}),
           _registration(params["remote_request_id"], decode_port="9")]
    for note in bad:
        agent.send_notif(prefill_agent, notif_msg=note)
    wait_until(lambda: _ignored(p, "malformed") >= before + len(bad), 120,
               "the prefill drops and counts the malformed notes",
               message=lambda: p.log_tail())
    r = decode(dec.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT,
               request_id="push-malformed")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == monolithic


def test_a_forged_registration_without_the_holds_key_writes_nothing(
        servers, forger, monolithic):
    """A well-formed registration naming a held request, from an agent without the hold's
    key: refused (stock vLLM matches it, WRITEs the prompt's KV where it says, and the real
    decode's registration then matches nothing); the real decode's, with the key, is
    written."""
    p, dec = servers
    agent, prefill_agent = forger
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT, request_id="push-forged")
    assert params.get("kvbridge_hold_key")  # the capability, for the decode to register with
    before = _ignored(p, "no_key")
    agent.send_notif(prefill_agent, notif_msg=_registration(params["remote_request_id"]))
    wait_until(lambda: _ignored(p, "no_key") == before + 1, 120,
               "the prefill refuses the registration without the key",
               message=lambda: p.log_tail())
    assert "push registration" in p.log_text() and "was refused" in p.log_text()
    r = decode(dec.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT,
               request_id="push-forged")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == monolithic
