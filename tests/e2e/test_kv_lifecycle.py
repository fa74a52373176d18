"""The KV lifecycle, for real: a decode never counts tokens as loaded that no READ covered;
no prefill block stays pinned by a request nobody will read; a READ that cannot finish
inside the prefill's lease is given up (cancelled, then recomputed or failed), never left
to land in blocks that are reused.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from kvbridge.connector.scheduler_side import lease_margin
from kvbridge.proxy import build_proxy_app
from kvbridge.tools.testing.api_server import BackgroundServer
from tests.e2e.conftest import PROMPTS, Serve, complete, free_port, start_all
from tests.helpers import wait_until

LONG = "A long prompt fills many blocks of the prefill's KV cache, on purpose. " * 14  # ~1 KB


def _prefill_params(p: Serve, prompt: str) -> dict:
    r = httpx.post(p.url + "/v1/completions", verify=p.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _release(p: Serve, params: dict, token: str) -> httpx.Response:
    return httpx.post(p.url + "/v1/kv/release", json=params, verify=p.verify, timeout=10,
                      headers={"authorization": f"Bearer {token}"})


def _wait(cond, timeout: float, what: str) -> float:
    """``wait_until`` ``cond``; returns how long it took."""
    t0 = time.monotonic()
    wait_until(cond, timeout, what, every=0.01)
    return time.monotonic() - t0


# -- coverage: short and long block lists ----------------------------------------------------

@pytest.mark.parametrize("shape", ["one block", "last block missing"])
def test_a_short_block_list_loads_what_is_there_and_computes_the_rest(
        cluster, reference, token_file, shape):
    p, d = cluster["p1-zmq"], cluster["d1"]
    prompt = PROMPTS[0]
    held = p.metric("kvbridge_held_requests")
    params = _prefill_params(p, prompt)
    blocks = params["remote_block_ids"]
    assert len(blocks) >= 3
    kept = blocks[:1] if shape == "one block" else blocks[:-1]
    # vLLM's shape (no remote_num_tokens): the decode can only trust the blocks it gets
    short = {k: v for k, v in params.items() if k != "remote_num_tokens"}
    short["remote_block_ids"] = kept
    loaded = d.metric("kvbridge_kv_blocks_loaded_total")
    assert complete(d.url, prompt, verify=d.verify, kv_transfer_params=short) == \
        reference[prompt]
    assert d.metric("kvbridge_kv_blocks_loaded_total") - loaded == len(kept)
    # with remote_num_tokens the prefill says it computed more than the blocks hold: a 400
    r = httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": prompt, "max_tokens": 4,
        "kv_transfer_params": {**params, "remote_block_ids": kept}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    # the READ's notification reaches the prefill on its own time: wait for it, then the
    # release route has nothing left to release
    _wait(lambda: p.metric("kvbridge_held_requests") <= held, 10, "the READ's release")
    assert _release(p, params, token_file.read_text()).json() == {"released": False}


def test_a_long_block_list_is_a_400_and_the_hold_can_be_released(cluster, token_file):
    p, d = cluster["p1-http"], cluster["d1"]
    free = p.metric("kvbridge_blocks_free")
    params = _prefill_params(p, PROMPTS[2])          # "short": one block
    assert p.metric("kvbridge_blocks_free") == free - 1
    longer = {**params, "remote_block_ids": params["remote_block_ids"] + [200]}
    r = httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPTS[2], "max_tokens": 4,
        "kv_transfer_params": longer})
    assert r.status_code == 400 and "needs at most 1" in r.json()["error"]["message"], r.text
    # Nobody will read it: the route frees a hold now (token required), not at lease end;
    # the decode that refused it does not (nothing proves the params were the caller's).
    token = token_file.read_text()
    unseen = _prefill_params(p, PROMPTS[2])
    assert _release(p, unseen, "wrong").status_code == 401
    assert _release(p, {**unseen, "remote_engine_id": "other"}, token).status_code == 409
    assert _release(p, unseen, token).json() == {"released": True}
    assert _release(p, params, token).json() == {"released": True}  # the refused one
    _wait(lambda: p.metric("kvbridge_blocks_free") == free, 5, "the released blocks")
    assert p.metric('kvbridge_held_requests_released_total{why="abandoned"}') >= 1


# -- no pinned KV through the proxy -----------------------------------------------------------

@pytest.fixture(scope="module")
def small_prefill(certs, token_file, serve_log_dir) -> Iterator[Serve]:
    """A prefill with room for two long prompts, and the default 30 s lease."""
    yield from (s["small-prefill"] for s in start_all({"small-prefill": (
        ("--role", "prefill", "--handshake", "http", "--num-blocks", "140",
         "--side-channel-port", "0", "--side-channel-token-file", str(token_file)), certs)},
        serve_log_dir))


def test_refused_requests_leave_nothing_held(cluster, small_prefill, certs, token_file):
    p, d = small_prefill, cluster["d1"]
    start = p.metric("kvbridge_blocks_free")
    app = build_proxy_app([p.url], [d.url], ca_certs=str(certs / "ca.pem"),
                          kv_token=token_file.read_text(), prewarm=False, metrics_route="open")
    dead = build_proxy_app([p.url], [f"http://127.0.0.1:{free_port()}"],
                           ca_certs=str(certs / "ca.pem"), kv_token=token_file.read_text(),
                           prewarm=False)
    with BackgroundServer(app) as proxy, BackgroundServer(dead) as dead_proxy:
        body = {"model": "kvbridge-tiny", "prompt": LONG, "temperature": 0}
        for _ in range(4):
            # refused by the decode's own rules before any prefill work
            r = httpx.post(proxy.url + "/v1/completions", json={**body, "max_tokens": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            # refused by the decode only (the context is too long for 100,000 new tokens),
            # and a decode that is down: the prefill computed, then its hold is released
            r = httpx.post(proxy.url + "/v1/completions", json={**body, "max_tokens": 100_000})
            assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
            r = httpx.post(dead_proxy.url + "/v1/completions", json={**body, "max_tokens": 4})
            assert r.status_code == 502
            took = _wait(lambda: p.metric("kvbridge_blocks_free") == start, 10,
                         "the prefill's blocks after refused requests (the lease is 30 s)")
            print(f"prefill blocks back {1000 * took:.0f} ms after the answers (via proxy)")
        t0 = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        elapsed = time.monotonic() - t0
        assert r.status_code == 200, r.text
        served = httpx.get(proxy.url + "/metrics").text
    # the max_tokens -1 requests never reached the prefill: 4 refused by the decode + 1
    assert "kvbridge_proxy_prefill_seconds_count 5.0" in served
    assert 'kvbridge_proxy_kv_releases_total{outcome="ok"} 4.0' in served
    assert elapsed < 15, f"a valid request waited {elapsed:.1f}s behind held blocks"
    _wait(lambda: p.metric("kvbridge_blocks_free") == start, 10, "the prefill's blocks")


# -- READs that cannot finish inside the lease -----------------------------------------------

# Over TCP a READ needs the prefill's NIXL agent to make progress: a stopped (SIGSTOP)
# prefill makes every READ from it hang, which is a READ slowed at will. (Through shared
# memory, UCX's default between processes of one host, it would not need the prefill.)
TCP = {"UCX_TLS": "tcp,self"}
LEASE = 6  # seconds: the decode's fence is the lease less its margin (lease_margin)
FENCE = LEASE - lease_margin(LEASE)  # when the decode gives up a READ it started at once


@pytest.fixture(scope="module")
def tcp_decodes(certs, token_file, serve_log_dir) -> Iterator[dict[str, Serve]]:
    side = ("--side-channel-token-file", str(token_file), "--handshake", "http")
    procs = {name: Serve(name, serve_log_dir, "--role", "decode", *policy, *side, tls=certs,
                         env=TCP)
             for name, policy in (("tcp-recompute", ()),
                                  ("tcp-fail", ("--kv-load-failure-policy", "fail")))}
    try:
        for proc in procs.values():
            proc.wait_ready(time.monotonic() + 180)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _tcp_prefill(name: str, certs, token_file, log_dir) -> Serve:
    p = Serve(name, log_dir, "--role", "prefill", "--handshake", "http", "--side-channel-port",
              "0", "--side-channel-token-file", str(token_file), "--kv-lease-seconds",
              str(LEASE), tls=certs, env=TCP)
    p.wait_ready(time.monotonic() + 180)
    return p


def _prewarm(d: Serve, params: dict, token: str) -> None:
    r = httpx.post(d.url + "/v1/kv/prewarm", verify=d.verify, timeout=30,
                   headers={"authorization": f"Bearer {token}"},
                   json={"host": params["remote_host"], "port": params["remote_port"],
                         "method": "http", "wait": True})
    assert r.status_code == 200, r.text


def _ask(d: Serve, prompt: str, params: dict) -> httpx.Response:
    return httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "kv_transfer_params": params})


def test_a_read_slower_than_the_lease_is_given_up_and_recomputed(
        tcp_decodes, certs, token_file, serve_log_dir):
    d = tcp_decodes["tcp-recompute"]
    p = _tcp_prefill("tcp-prefill-slow", certs, token_file, serve_log_dir)
    try:
        t0 = time.monotonic()
        reference = _ask(d, LONG, None).json()["choices"][0]["text"]
        compute = time.monotonic() - t0  # the whole prompt computed here, on this machine now
        params = _prefill_params(p, LONG)
        _prewarm(d, params, token_file.read_text())
        free, recomputed = d.metric("kvbridge_blocks_free"), d.metric(
            "kvbridge_requests_recomputed_total")
        p.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = _ask(d, LONG, params)
            elapsed = time.monotonic() - t0
        finally:
            p.proc.send_signal(signal.SIGCONT)
        # given up inside the lease, the prompt computed here: the right answer
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
        assert d.metric("kvbridge_requests_recomputed_total") == recomputed + 1
        # given up at the fence, then computed: a READ waited on until the client's 60 s
        # would not fit (the allowance: 3 computes and 2 s more, for a busy 2-core machine)
        bound = FENCE + 3 * compute + 2.0
        assert elapsed < bound, f"the decode held on to its READ for {elapsed:.1f}s ({bound=})"
        assert "before the prefill's lease" in d.log.read_text()
        # the prefill, resumed, would now serve a READ still in flight: the cancelled one
        # never lands in the decode's blocks, which the next requests reuse
        _wait(lambda: p.metric("kvbridge_held_requests") == 0, 10, "the lease to end")
        for _ in range(3):
            assert _ask(d, LONG, None).json()["choices"][0]["text"] == reference
        assert d.metric("kvbridge_blocks_free") == free
    finally:
        p.stop()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_prefill_killed_mid_read(tcp_decodes, certs, token_file, serve_log_dir, policy):
    d = tcp_decodes[f"tcp-{policy}"]
    p = _tcp_prefill(f"tcp-prefill-kill-{policy}", certs, token_file, serve_log_dir)
    reference = _ask(tcp_decodes["tcp-recompute"], LONG, None).json()["choices"][0]["text"]
    params = _prefill_params(p, LONG)
    _prewarm(d, params, token_file.read_text())
    free = d.metric("kvbridge_blocks_free")
    p.proc.send_signal(signal.SIGSTOP)  # the READ starts and hangs ...
    try:
        with httpx.Client(verify=d.verify, timeout=60) as c:
            pending = c.build_request("POST", d.url + "/v1/completions", json={
                "model": "kvbridge-tiny", "prompt": LONG, "max_tokens": 8, "temperature": 0,
                "kv_transfer_params": params})
            with cf.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(c.send, pending)
                _wait(lambda: d.metric("kvbridge_blocks_free") < free, 10,
                      "the decode to allocate blocks for the READ")
                p.proc.send_signal(signal.SIGKILL)  # ... and its prefill dies under it
                r = fut.result()
    finally:
        p.proc.send_signal(signal.SIGCONT)
        p.proc.wait()
    if policy == "recompute":
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
    else:
        assert r.status_code == 502, r.text
        assert "KV load failed" in r.json()["error"]["message"]
    _wait(lambda: d.metric("kvbridge_blocks_free") == free, 10, "the decode's blocks")
    assert _ask(d, PROMPTS[2], None).status_code == 200  # and it keeps serving


def test_a_decode_that_refuses_a_request_releases_nothing(cluster, reference, token_file):
    """Anyone who reaches a decode can name another request's hold in a request the decode
    refuses: the decode must not release it (it cannot tell the params are the caller's).
    The hold stays for its reader, or until the release route (with the token) or the lease."""
    p, d = cluster["p2-zmq"], cluster["d2"]
    prompt = PROMPTS[1]
    # a first request: the decode handshakes with this prefill (and reads)
    assert complete(d.url, prompt, verify=d.verify,
                    kv_transfer_params=_prefill_params(p, prompt)) == reference[prompt]
    _wait(lambda: p.metric("kvbridge_held_requests") == 0
          and p.metric("kvbridge_blocks_used") == 0, 10, "the first READ's release")
    start = p.metric("kvbridge_blocks_free")
    victims = []
    for bad in ({"max_tokens": -1}, {"max_tokens": 100_000}, {"model": "not-this-one"}):
        params = _prefill_params(p, prompt)
        victims.append(params)
        r = httpx.post(d.url + "/v1/completions", verify=d.verify, timeout=60, json={
            "model": "kvbridge-tiny", "prompt": prompt, "temperature": 0, **bad,
            "kv_transfer_params": params})
        assert r.status_code in (400, 404), r.text
    # A READ after them from the same decode: its release reaches the prefill after any
    # notification the refusals could have sent; once it is in, the three are still held.
    assert complete(d.url, prompt, verify=d.verify,
                    kv_transfer_params=_prefill_params(p, prompt)) == reference[prompt]
    _wait(lambda: p.metric("kvbridge_held_requests") == 3, 10, "the last READ's release")
    assert p.metric("kvbridge_blocks_free") < start
    # whoever got them from the prefill (a proxy, with the token) releases them
    for params in victims:
        assert _release(p, params, token_file.read_text()).json() == {"released": True}
    _wait(lambda: p.metric("kvbridge_blocks_free") == start, 10, "the released blocks")


# -- a hold is a capability, and a READ is validated -----------------------------------------

def _stale(d: Serve) -> float:
    return d.metric("kvbridge_kv_loads_stale_total")


@pytest.mark.parametrize("attack", ["reordered blocks", "another prompt", "released and reused"])
def test_a_read_of_blocks_that_are_not_the_prompts_is_never_used(
        cluster, reference, token_file, attack):
    """The decode READs the blocks, then their tags: blocks that do not hold this prompt's
    KV at this position (kvbridge.kv_tags) fail the load, which is recomputed - the answer
    is the monolithic one, never text from someone else's KV."""
    p, d = cluster["p1-http"], cluster["d1"]
    token = token_file.read_text()
    prompt = PROMPTS[0]
    ref = cluster["ref"]
    params = _prefill_params(p, prompt)
    assert len(params["remote_block_ids"]) >= 3
    ask = prompt
    if attack == "reordered blocks":
        params = {**params, "remote_block_ids": params["remote_block_ids"][::-1]}
    elif attack == "another prompt":
        ask = prompt[::-1]  # as many tokens (the tiny model's tokenizer is byte-level)
    else:
        assert _release(p, params, token).json() == {"released": True}
        _wait(lambda: p.metric("kvbridge_held_requests") == 0, 10, "the release")
        # the freed blocks are taken by another prompt's KV (the free list is cycled
        # through until they are: bounded by the prefill's block count)
        for _ in range(int(p.metric("kvbridge_blocks_free"))):
            other = _prefill_params(p, prompt[::-1])
            assert _release(p, other, token).json() == {"released": True}
            if set(other["remote_block_ids"]) & set(params["remote_block_ids"]):
                break
        else:
            raise AssertionError("the released blocks were never reused")
    want = reference[prompt] if ask == prompt else complete(ref.url, ask, verify=ref.verify)
    stale = _stale(d)
    assert complete(d.url, ask, verify=d.verify, kv_transfer_params=params) == want
    assert _stale(d) == stale + 1
    _wait(lambda: p.metric("kvbridge_held_requests") == 0, 10, "the holds' release")


def test_a_release_needs_the_holds_key(cluster, token_file):
    """Releases (the route, or a decode's note) without the key the params carried are
    ignored and counted: knowing a request id (or the side-channel token) is not enough."""
    p = cluster["p2-http"]
    token = token_file.read_text()
    params = _prefill_params(p, PROMPTS[1])
    assert len(params["remote_hold_key"]) == 32
    ignored = p.metric('kvbridge_kv_notes_ignored_total{why="bad_key"}')
    keyless = {k: v for k, v in params.items() if k != "remote_hold_key"}
    assert _release(p, keyless, token).json() == {"released": False}
    assert _release(p, {**params, "remote_hold_key": "0" * 32}, token).json() == \
        {"released": False}
    assert p.metric('kvbridge_kv_notes_ignored_total{why="bad_key"}') == ignored + 2
    assert p.metric("kvbridge_held_requests") >= 1
    assert _release(p, params, token).json() == {"released": True}
