"""Handshaking ahead of the first request, for real: ``kvbridge serve --kv-peer`` at
start-up, and every answer of a decode's ``POST /v1/kv/prewarm`` (protocol.md §13).

One decode process of its own (``--kv-peer`` is a start-up flag), pointed at prefills of
the shared cluster.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import PROMPTS, Serve
from tests.e2e.conftest import complete as _complete
from tests.helpers import wait_until

HANDSHAKES = "kvbridge_handshake_seconds_count"


def _info(p: Serve) -> dict:
    return httpx.get(p.url + "/v1/kv/info", verify=p.verify, timeout=10).json()


@pytest.fixture(scope="module")
def warm_decode(cluster, certs, token_file, serve_log_dir) -> Iterator[Serve]:
    """A TP-1 decode started with ``--kv-peer`` naming the cluster's p1-zmq side channel."""
    info = _info(cluster["p1-zmq"])
    d = Serve("kv-peer-decode", serve_log_dir, "--role", "decode", "--kv-peer",
              f"{info['side_channel_host']}:{info['side_channel_port']}",
              "--side-channel-token-file", str(token_file), "--handshake-timeout", "5",
              tls=certs)
    try:
        d.wait_ready(time.monotonic() + 180)
        yield d
    finally:
        d.stop()


def _wait_metric(d: Serve, name: str, at_least: float, what: str) -> None:
    wait_until(lambda: d.metric(name) >= at_least, 30, what, every=0.05,
               message=lambda: f"{name} = {d.metric(name)}")


def _held_params(p: Serve, prompt: str) -> dict:
    r = httpx.post(p.url + "/v1/completions", verify=p.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_kv_peer_handshakes_at_start_up(cluster, reference, warm_decode):
    d, p = warm_decode, cluster["p1-zmq"]
    _wait_metric(d, HANDSHAKES, 1, "the start-up handshake with --kv-peer")
    handshakes = d.metric(HANDSHAKES)
    ok = d.metric('kvbridge_kv_loads_total{outcome="ok"}')
    prompt = PROMPTS[0]
    got = _complete(d.url, prompt, verify=d.verify, kv_transfer_params=_held_params(p, prompt))
    assert got == reference[prompt]
    # the KV was read, and the first request paid no handshake: it was done at start-up
    assert d.metric('kvbridge_kv_loads_total{outcome="ok"}') == ok + 1
    assert d.metric(HANDSHAKES) == handshakes


def _prewarm(d: Serve, *, token: str | None, **kw) -> httpx.Response:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    return httpx.post(d.url + "/v1/kv/prewarm", verify=d.verify, timeout=60, headers=headers,
                      **kw)


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_prewarm_without_the_token_is_a_401(warm_decode, token):
    r = _prewarm(warm_decode, token=token, json={"host": "127.0.0.1", "port": 1})
    assert r.status_code == 401, r.text
    assert "token" in r.json()["error"]["message"]


@pytest.mark.parametrize("kw", [
    {"content": b"{not json"},
    {"json": ["127.0.0.1", 5600]},
    {"json": {"host": "127.0.0.1"}},                      # no port
    {"json": {"host": "127.0.0.1", "port": "many"}},
    {"json": {"host": "127.0.0.1", "port": "5600"}},      # no coercion
    {"json": {"host": "127.0.0.1", "port": 5600.5}},
    {"json": {"host": "127.0.0.1", "port": 70000}},
    {"json": {"host": "", "port": 5600}},
    {"json": {"host": "127.0.0.1", "port": 5600, "wait": "yes"}},
    # a lone surrogate: valid to a lenient JSON decoder, no string any encoder can write
    {"content": b'{"host": "h\\ud800", "port": 5600}'},
], ids=["not-json", "not-an-object", "no-port", "port-not-a-number", "port-a-string",
        "port-a-float", "port-out-of-range", "empty-host", "wait-not-a-bool",
        "lone-surrogate"])
def test_malformed_prewarm_is_a_400(warm_decode, token_file, reference, kw):
    d = warm_decode
    r = _prewarm(d, token=token_file.read_text(), **kw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert _complete(d.url, PROMPTS[2], verify=d.verify) == reference[PROMPTS[2]]


def test_failed_discovery_is_a_502_naming_the_peer(cluster, warm_decode, token_file, reference):
    """The prefill's API port is no side channel: its 404 fails the discovery at once."""
    d, api = warm_decode, cluster["p1-http"]
    port = int(api.url.rsplit(":", 1)[1])
    r = _prewarm(d, token=token_file.read_text(),
                 json={"host": "127.0.0.1", "port": port, "method": "http"})
    assert r.status_code == 502, r.text
    assert f"prewarm of 127.0.0.1:{port} failed" in r.json()["error"]["message"]
    assert _complete(d.url, PROMPTS[2], verify=d.verify) == reference[PROMPTS[2]]


def test_prewarm_with_wait_handshakes_every_rank(cluster, warm_decode, token_file, reference):
    d, p = warm_decode, cluster["p2-http"]
    info = _info(p)
    handshakes = d.metric(HANDSHAKES)
    r = _prewarm(d, token=token_file.read_text(), json={
        "host": info["side_channel_host"], "port": info["side_channel_port"],
        "method": "http", "wait": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "done" and body["engine_id"] == info["engine_id"]
    assert body["tp_size"] == 2 and body["handshake_method"] == "http"
    assert d.metric(HANDSHAKES) == handshakes + 1  # one per decode rank (this one has one)
    prompt = PROMPTS[1]
    got = _complete(d.url, prompt, verify=d.verify, kv_transfer_params=_held_params(p, prompt))
    assert got == reference[prompt]
    assert d.metric(HANDSHAKES) == handshakes + 1  # the request paid none
