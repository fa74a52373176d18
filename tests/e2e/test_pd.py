"""The seed's test plan for real: prefill and decode ``kvbridge serve`` processes at
different TP sizes, a proxy, and a client; greedy output must equal a single
``--role both`` engine's, and no KV block may leak.

All engines run the built-in tiny model in float64, so TP sizes that differ
round differently only far below what could flip a greedy token.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

from kvbridge.proxy import build_proxy_app
from kvbridge.tools.launch import read_metric
from kvbridge.tools.testing.api_server import BackgroundServer
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, Serve
from tests.e2e.conftest import complete as _complete
from tests.helpers import wait_until

CONFIGS = [(1, 1), (1, 2), (2, 1), (2, 2)]


def _proxy(cluster, certs, prefill: str, decode: str) -> BackgroundServer:
    app = build_proxy_app([cluster[prefill].url], [cluster[decode].url],
                          ca_certs=str(certs / "ca.pem"), metrics_route="open")
    return BackgroundServer(app)


def _wait_blocks_back(engines: list[Serve], start: dict[str, float]) -> None:
    """Prefill frees its held blocks when decode's READ notifications arrive, a moment
    after the answer: wait for that condition (bounded), then compare."""
    wait_until(lambda: all(e.metric("kvbridge_blocks_free") == start[e.name] for e in engines),
               20, "every engine's blocks back", every=0.05,
               message=lambda: {e.name: e.metric("kvbridge_blocks_free") for e in engines})


@pytest.mark.parametrize("method", ["http", "zmq"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), CONFIGS)
def test_pd_matches_single_engine(cluster, reference, certs, method, prefill_tp, decode_tp):
    p, d = cluster[f"p{prefill_tp}-{method}"], cluster[f"d{decode_tp}"]
    start = {e.name: e.metric("kvbridge_blocks_free") for e in (p, d)}
    loads = d.metric("kvbridge_kv_loads_total")
    # the module's cluster is shared: other modules' tests fail loads on purpose
    failed = d.metric('kvbridge_kv_loads_total{outcome="failed"}')
    with _proxy(cluster, certs, p.name, d.name) as proxy:
        for i, prompt in enumerate(PROMPTS):
            got = _complete(proxy.url, prompt, stream=bool(i % 2))
            assert got == reference[prompt], (prompt, got)
    # every request's KV came over NIXL (none recomputed)
    assert d.metric("kvbridge_kv_loads_total") - loads == len(PROMPTS)
    assert d.metric('kvbridge_kv_loads_total{outcome="failed"}') == failed
    _wait_blocks_back([p, d], start)


def test_concurrent_requests(cluster, reference, certs):
    p, d = cluster["p2-http"], cluster["d2"]
    start = {e.name: e.metric("kvbridge_blocks_free") for e in (p, d)}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    with _proxy(cluster, certs, p.name, d.name) as proxy, cf.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda ip: _complete(proxy.url, ip[1], stream=bool(ip[0] % 2)),
                            enumerate(prompts)))
    assert got == [reference[q] for q in prompts]
    _wait_blocks_back([p, d], start)


def test_misplaced_blocks_are_caught_not_answered_from(cluster, reference, certs):
    """Feed the decode the prefill's blocks in the wrong order: the READ is done, but the
    blocks' tags (protocol.md 9a) show they are not this prompt's, so the decode recomputes
    rather than answer from them (tests/test_engine.py shows a wrong copy does change the
    answer when nothing checks it)."""
    p, d = cluster["p1-zmq"], cluster["d1"]
    prompt = PROMPTS[0]
    r = httpx.post(p.url + "/v1/completions", verify=p.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    params = r.json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) >= 3
    params["remote_block_ids"] = params["remote_block_ids"][::-1]
    failed = d.metric('kvbridge_kv_loads_total{outcome="failed"}')
    stale = d.metric("kvbridge_kv_loads_stale_total")
    got = _complete(d.url, prompt, verify=d.verify, kv_transfer_params=params)
    assert got == reference[prompt]
    assert d.metric('kvbridge_kv_loads_total{outcome="failed"}') == failed + 1
    assert d.metric("kvbridge_kv_loads_stale_total") == stale + 1


def _dead_params(cluster) -> dict:
    """Params naming a prefill whose side channel is down (a port nobody listens on)."""
    from tests.e2e.conftest import free_port

    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "gone", "remote_block_ids": [0, 1, 2, 3, 4, 5],
            "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": free_port(),
            "tp_size": 1, "handshake_method": "http"}


def test_dead_side_channel_recompute(cluster, reference):
    d = cluster["d1"]
    free = d.metric("kvbridge_blocks_free")
    recomputed = d.metric("kvbridge_requests_recomputed_total")
    prompt = PROMPTS[1]
    got = _complete(d.url, prompt, verify=d.verify, kv_transfer_params=_dead_params(cluster))
    assert got == reference[prompt]
    assert d.metric("kvbridge_blocks_free") == free
    assert d.metric("kvbridge_requests_recomputed_total") == recomputed + 1
    # and it keeps serving
    assert _complete(d.url, PROMPTS[2], verify=d.verify) == reference[PROMPTS[2]]


def test_dead_side_channel_fail_policy(cluster, reference):
    d = cluster["d1-fail"]
    free = d.metric("kvbridge_blocks_free")
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
        "temperature": 0, "kv_transfer_params": _dead_params(cluster)})
    elapsed = time.monotonic() - t0
    assert r.status_code == 502, r.text  # the fail policy's documented status
    err = r.json()["error"]
    assert err["message"].startswith("KV load failed"), err
    assert "handshake" in err["message"].lower(), err
    assert elapsed < 5 + 3  # the handshake timeout plus a margin, never an OS default
    assert d.metric("kvbridge_blocks_free") == free
    assert _complete(d.url, PROMPTS[2], verify=d.verify) == reference[PROMPTS[2]]


# --- bad input: the request fails with a 4xx that says why; nothing else is disturbed -------

def _info(p: Serve) -> dict:
    return httpx.get(p.url + "/v1/kv/info", verify=p.verify, timeout=10).json()


def _bad_params(cluster, **override) -> dict:
    info = _info(cluster["p1-zmq"])
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_engine_id": info["engine_id"], "remote_block_ids": [0, 1],
              "remote_request_id": "nobody", "remote_host": info["side_channel_host"],
              "remote_port": info["side_channel_port"], "tp_size": 1,
              "remote_epoch": info["epoch"], "handshake_method": "zmq"}
    return {**params, **override}


@pytest.mark.parametrize("decode", ["d1", "d1-fail"])
@pytest.mark.parametrize("override", [
    {"remote_engine_id": "not-that-engine"},          # side channel answers for another engine
    {"tp_size": 2},                                   # it is not a TP-2 instance
    {"remote_block_ids": [0, 10**6]},                 # blocks it does not have
    {"remote_port": "not-a-port"},                    # wrong types
    {"remote_block_ids": [-1]},
    {"handshake_method": "carrier-pigeon"},
])
def test_bad_kv_transfer_params_are_a_400(cluster, reference, decode, override):
    d = cluster[decode]
    free = d.metric("kvbridge_blocks_free")
    r = httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPTS[0], "max_tokens": 4,
        "kv_transfer_params": _bad_params(cluster, **override)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and "invalid kv_transfer_params" in err["message"]
    assert d.metric("kvbridge_blocks_free") == free
    assert _complete(d.url, PROMPTS[2], verify=d.verify) == reference[PROMPTS[2]]


def test_side_channel_is_not_on_the_api_port(cluster):
    for name in ("p1-http", "p2-zmq"):
        p = cluster[name]
        for path in ("/v1/kv/handshake", "/v1/kv/handshake/0", "/readyz"):
            assert httpx.get(p.url + path, verify=p.verify).status_code == 404, (name, path)


def test_proxy_bad_input_reaches_the_client_at_once(cluster, certs):
    with _proxy(cluster, certs, "p1-http", "d1") as proxy:
        r = httpx.post(proxy.url + "/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "kvbridge-tiny",
                                                            "prompt": 42, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["message"]
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "kvbridge-tiny",
                                                            "prompt": "x" * 100_000})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_metrics_move_by_exactly_what_happened(cluster, reference, certs):
    """A handful of requests moves the counters by exactly what the requests did."""
    p, d = cluster["p1-zmq"], cluster["d2"]
    names = ["kvbridge_kv_loads_total", "kvbridge_kv_blocks_loaded_total",
             "kvbridge_kv_bytes_loaded_total", 'kvbridge_kv_loads_total{outcome="failed"}']
    before = {n: d.metric(n) for n in names}
    released = p.metric('kvbridge_held_requests_released_total{why="read"}')
    with _proxy(cluster, certs, p.name, d.name) as proxy:
        for prompt in PROMPTS:
            assert _complete(proxy.url, prompt) == reference[prompt]
        served = httpx.get(proxy.url + "/metrics").text
    assert 'kvbridge_proxy_requests_total{route="/v1/completions",status="200"} 3.0' in served
    # the byte tokenizer: one token per byte plus BOS; 16 tokens per block
    blocks = sum(-(-(len(q.encode()) + 1) // 16) for q in PROMPTS)
    block_bytes = 2 * 2 * 4 * 16 * 16 * 8  # layers, K/V, KV heads, block size, head dim, f64
    delta = {n: d.metric(n) - before[n] for n in names}
    assert delta == {names[0]: len(PROMPTS), names[1]: blocks, names[2]: blocks * block_bytes,
                     names[3]: 0}
    wait_until(lambda: p.metric('kvbridge_held_requests_released_total{why="read"}')
               >= released + 3, 20, "prefill saw every READ notification", every=0.05)
    assert p.metric('kvbridge_held_requests_released_total{why="read"}') == released + 3


# -- the first token straight from the prefill ------------------------------------------------

def _stream_chat(url: str, verify=True, **extra) -> str:
    body = {"model": "kvbridge-tiny", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": PROMPTS[1]}], **extra}
    text = []
    with httpx.Client(timeout=60, verify=verify) as c, c.stream(
            "POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["delta"].get("content", ""))
    return "".join(text)


def _proxy_metric(proxy: BackgroundServer, name: str) -> float:
    with httpx.Client() as c:
        return read_metric(c, proxy.url, name)


FROM_PREFILL = 'kvbridge_proxy_first_token_from_total{source="prefill"}'


@pytest.mark.parametrize("first_token_from", ["prefill", "decode"])
def test_the_first_token_from_the_prefill_gives_the_same_text(cluster, reference, certs,
                                                              first_token_from):
    """Streamed through the proxy, the first token comes from the prefill's answer and the
    decode continues after it: the text is the single engine's, greedy and seeded, for
    completions and chat; with ``decode`` every token comes from the decode."""
    p, d, ref = cluster["p2-http"], cluster["d1"], cluster["ref"]
    start = {e.name: e.metric("kvbridge_blocks_free") for e in (p, d)}
    seeded = {"temperature": 0.9, "seed": 11}
    want_seeded = _complete(ref.url, PROMPTS[0], verify=ref.verify, **seeded)
    want_chat = _stream_chat(ref.url, ref.verify)
    app = build_proxy_app([p.url], [d.url], ca_certs=str(certs / "ca.pem"),
                          metrics_route="open", first_token_from=first_token_from)
    with BackgroundServer(app) as proxy:
        for prompt in PROMPTS:
            assert _complete(proxy.url, prompt, stream=True) == reference[prompt], prompt
        assert _complete(proxy.url, PROMPTS[0], stream=True, **seeded) == want_seeded
        assert _stream_chat(proxy.url) == want_chat
        from_prefill = _proxy_metric(proxy, FROM_PREFILL)
    assert from_prefill == (len(PROMPTS) + 2 if first_token_from == "prefill" else 0)
    _wait_blocks_back([p, d], start)


def test_a_one_token_answer_comes_from_the_prefill_alone(cluster, reference, certs,
                                                         token_file):
    """``max_tokens: 1`` (or a first token that ends the answer): the prefill's token is the
    whole answer, no decode is asked, and the prefill's hold is released at once."""
    p, d = cluster["p1-http"], cluster["d2"]
    start = {e.name: e.metric("kvbridge_blocks_free") for e in (p, d)}
    decoded = d.metric('kvbridge_kv_loads_total')
    app = build_proxy_app([p.url], [d.url], ca_certs=str(certs / "ca.pem"),
                          metrics_route="open", kv_token=token_file.read_text())
    with BackgroundServer(app) as proxy:
        got = _complete(proxy.url, PROMPTS[0], stream=True, max_tokens=1)
        ref = cluster["ref"]
        assert got == _complete(ref.url, PROMPTS[0], verify=ref.verify, max_tokens=1)
        assert _proxy_metric(proxy, FROM_PREFILL) == 1
    assert d.metric('kvbridge_kv_loads_total') == decoded
    _wait_blocks_back([p, d], start)
