"""The trust layer on real instances: mutual TLS everywhere, a certificate allow-list and
scoped named tokens, and the proxy's releases and prewarms going through all of it.

One prefill and one decode of their own (the allow-list, tokens and audit log are
start-up settings); every API and side-channel connection presents a client certificate.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbridge.config import TLSConfig
from kvbridge.errors import HandshakeError
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.proxy import build_proxy_app
from kvbridge.tools.launch import free_port
from kvbridge.tools.testing.api_server import BackgroundServer
from kvbridge.tools.testing.certs import issue, new_ca
from tests.e2e.conftest import PROMPTS, Serve
from tests.helpers import RogueSideChannel, compat, wait_until

ALLOWED = "decode-*.kv.internal,proxy.kv.internal"
TRUSTED = "KVBRIDGE_TRUSTED_SIDE_CHANNELS"
LONG = "A long prompt fills many blocks of the prefill's KV cache, on purpose. " * 14


def _secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``prefill.pem`` (what ``Serve`` presents: both instances) names 127.0.0.1 and
    ``decode-a.kv.internal``; the proxy's and an intruder's client certificates."""
    d = tmp_path_factory.mktemp("allow-list-pki")
    ca = new_ca(d)
    issue(ca, d, "prefill", "127.0.0.1", "decode-a.kv.internal")
    issue(ca, d, "proxy", "proxy.kv.internal")
    issue(ca, d, "intruder", "intruder.kv.internal")
    # a server of the attacker's with a certificate of the same CA for the host it names
    issue(ca, d, "rogue", "127.0.0.1")
    _secret(d / "tokens", "# the proxy releases and prewarms; the decode reads metadata\n"
                          "proxy[release,prewarm]:tok-proxy\ndecode-a[metadata]:tok-decode\n")
    _secret(d / "decode-token", "tok-decode\n")
    return d


def _ctx(pki: Path, name: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / f"{name}.pem"), str(pki / f"{name}.key"))
    return ctx


@pytest.fixture(scope="module")
def pair(pki: Path, serve_log_dir: Path) -> Iterator[dict[str, Serve]]:
    trust = ("--ssl-cert-reqs", "required", "--side-channel-ssl-allowed-peers", ALLOWED,
             "--side-channel-tokens-file", str(pki / "tokens"), "--handshake", "http",
             "--handshake-timeout", "5")
    side_port = free_port()
    procs = {"al-prefill": Serve("al-prefill", serve_log_dir, "--role", "prefill", *trust,
                                 "--side-channel-port", str(side_port), "--audit-log",
                                 str(pki / "audit.jsonl"),
                                 # the holds the refused reads leave are drained at exit
                                 "--kv-lease-seconds", "5", tls=pki),
             # the decode presents its token to the prefill's side channel only
             "al-decode": Serve("al-decode", serve_log_dir, "--role", "decode", *trust,
                                "--side-channel-port", "0", "--side-channel-token-file",
                                str(pki / "decode-token"), tls=pki,
                                env={TRUSTED: f"127.0.0.1:{side_port}"})}
    try:
        deadline = time.monotonic() + 180
        for p in procs.values():
            p.verify = _ctx(pki, "proxy")  # the APIs require a client certificate
            p.wait_ready(deadline)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _proxy(pki: Path, pair: dict[str, Serve], cert: str) -> BackgroundServer:
    return BackgroundServer(build_proxy_app(
        [pair["al-prefill"].url], [pair["al-decode"].url], ca_certs=str(pki / "ca.pem"),
        client_cert=(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key")),
        kv_token="tok-proxy", prewarm=True, admin_routes="open", metrics_route="open"))


def _prewarmed(proxy: BackgroundServer) -> list[dict]:
    with httpx.Client(base_url=proxy.url, timeout=10) as c:
        wait_until(lambda: c.get("/v1/kv/prewarm").json()["done"], 60, "the proxy's prewarm",
                   every=0.05)
        return c.get("/v1/kv/prewarm").json()["pairs"]


def test_releases_and_prewarms_through_the_proxy_pass_the_allow_list(pki, pair):
    p = pair["al-prefill"]
    start = p.metric("kvbridge_blocks_free")
    with _proxy(pki, pair, "proxy") as proxy, httpx.Client(base_url=proxy.url,
                                                           timeout=60) as c:
        assert [pp["outcome"] for pp in _prewarmed(proxy)] == ["ok"]
        body = {"model": "kvbridge-tiny", "prompt": LONG, "temperature": 0}
        # refused by the decode after the prefill computed: the proxy releases the hold
        r = c.post("/v1/completions", json={**body, "max_tokens": 100_000})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
        wait_until(lambda: 'kvbridge_proxy_kv_releases_total{outcome="ok"} 1.0'
                   in c.get("/metrics").text, 10, "the release")
        wait_until(lambda: p.metric("kvbridge_blocks_free") == start, 10,
                   "the prefill's blocks back (the lease is 30 s)")
        # and a request is served: the decode's READ passed the side channel's checks
        r = c.post("/v1/completions", json={**body, "prompt": PROMPTS[0], "max_tokens": 4})
        assert r.status_code == 200, r.text
    audit = [json.loads(line) for line in (pki / "audit.jsonl").read_text().splitlines()]
    assert any(a["result"].startswith("released ") and a["token"] == "proxy"
               and a["cert"] == "proxy.kv.internal" and a["route"] == "release" for a in audit)
    assert any(a["route"].startswith("handshake") and a["result"] == "ok"
               and a["token"] == "decode-a" for a in audit)


def test_a_proxy_off_the_allow_list_is_refused_with_a_403_that_says_why(pki, pair, caplog):
    with caplog.at_level(logging.ERROR, logger="kvbridge.proxy"), \
            _proxy(pki, pair, "intruder") as proxy:
        [outcome] = [pp["outcome"] for pp in _prewarmed(proxy)]
    assert outcome.startswith("403") and "intruder.kv.internal" in outcome, outcome
    logged = [r.getMessage() for r in caplog.records if "prewarm of" in r.getMessage()]
    assert logged and "client certificate" in logged[0] and "--kv-token-file" not in logged[0]
    # the release route says the same to a caller with the right token
    r = httpx.post(pair["al-prefill"].url + "/v1/kv/release", verify=_ctx(pki, "intruder"),
                   json={}, headers={"authorization": "Bearer tok-proxy"}, timeout=10)
    assert r.status_code == 403 and "not allowed" in r.json()["error"]["message"]


def test_the_proxys_token_has_only_its_scopes(pki, pair):
    p = pair["al-prefill"]
    info = httpx.get(p.url + "/v1/kv/info", verify=p.verify, timeout=10).json()
    # the proxy's token and certificate cannot read the prefill's metadata ...
    client = HttpHandshakeClient(5, compat(), "tok-proxy", tls=TLSConfig(
        str(pki / "proxy.pem"), str(pki / "proxy.key"), str(pki / "ca.pem")))
    try:
        with pytest.raises(HandshakeError, match="'metadata' scope"):
            client.fetch("127.0.0.1", info["side_channel_port"], 0)
    finally:
        client.close()
    # ... and the decode's token cannot release
    r = httpx.post(p.url + "/v1/kv/release", verify=p.verify, json={}, timeout=10,
                   headers={"authorization": "Bearer tok-decode"})
    assert r.status_code == 403 and "'release' scope" in r.json()["error"]["message"]


def test_a_release_with_a_wrong_key_is_audited_apart_from_not_held(pki, pair):
    p = pair["al-prefill"]
    r = httpx.post(p.url + "/v1/completions", verify=p.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    rid = params["remote_request_id"]

    def release(body: dict) -> bool:
        r = httpx.post(p.url + "/v1/kv/release", verify=p.verify, json=body, timeout=10,
                       headers={"authorization": "Bearer tok-proxy"})
        assert r.status_code == 200, r.text
        return r.json()["released"]

    assert not release({**params, "remote_hold_key": "0" * 32})
    assert not release({**params, "remote_request_id": "never-held"})
    assert release(params)
    assert not release(params)  # released already: not held
    audit = [json.loads(line)["result"] for line in
             (pki / "audit.jsonl").read_text().splitlines()]
    assert audit[-4:] == [f"wrong key {rid}", "not held never-held", f"released {rid}",
                          f"not held {rid}"]


# -- the token-scope detour: a decode presents its token only to side channels it trusts --

@pytest.fixture
def rogue(pki: Path) -> Iterator[RogueSideChannel]:
    with RogueSideChannel(pki / "rogue.pem", pki / "rogue.key") as server:
        yield server


def test_the_proxys_token_cannot_make_the_decode_present_its_token_elsewhere(pki, pair, rogue):
    """The proxy's token may prewarm: a prewarm naming the attacker's side channel (a
    certificate of the same CA for the host it names) is refused, and the attacker never
    sees the decode's metadata-scoped token."""
    d = pair["al-decode"]
    r = httpx.post(d.url + "/v1/kv/prewarm", verify=_ctx(pki, "proxy"), timeout=60,
                   headers={"authorization": "Bearer tok-proxy"},
                   json={"host": "127.0.0.1", "port": rogue.port, "wait": True})
    assert rogue.authorizations == []
    assert r.status_code == 502 and "trusted_side_channels" in r.json()["error"]["message"], (
        r.text)


def test_a_completion_naming_another_side_channel_does_not_get_the_token(pki, pair, rogue):
    """A completion sent straight to the decode, its kv_transfer_params naming the
    attacker's side channel: a 400 (never recomputed, as for params naming another
    engine), the token kept."""
    p, d = pair["al-prefill"], pair["al-decode"]
    r = httpx.post(p.url + "/v1/completions", verify=p.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPTS[2], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    # an engine the decode has not handshaken with (a known one's peer would be reused)
    params = {**r.json()["kv_transfer_params"], "remote_engine_id": "attackers-engine",
              "remote_host": "127.0.0.1", "remote_port": rogue.port}
    r = httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0,
        "kv_transfer_params": params})
    assert rogue.authorizations == []
    assert r.status_code == 400 and "trusted_side_channels" in r.json()["error"]["message"], (
        r.text)
