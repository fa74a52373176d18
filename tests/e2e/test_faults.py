"""Faults, for real: prefills killed with SIGKILL, restarted on the same ports, drained
with SIGTERM; a decode killed mid-request; side channels that never answer.

Every request either recomputes (policy ``recompute``) or fails fast with a reason
(policy ``fail``), the engines keep serving, and no KV block is lost.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import Serve, free_port, start_all
from tests.helpers import wait_until

PROMPT = "Faults happen: a prefill dies, a decode dies, a side channel goes quiet. " * 2
TIMEOUT = 3  # handshake timeout of every instance here


def _side(token_file) -> tuple[str, ...]:
    return ("--side-channel-token-file", str(token_file), "--handshake-timeout", str(TIMEOUT),
            "--transfer-timeout", "5")


@pytest.fixture(scope="module")
def decodes(certs, token_file, serve_log_dir) -> Iterator[dict[str, Serve]]:
    side = _side(token_file)
    yield from start_all({
        "fd-recompute": (("--role", "decode", *side), certs),
        "fd-fail": (("--role", "decode", "--kv-load-failure-policy", "fail", *side), certs),
    }, serve_log_dir)


@pytest.fixture(scope="module")
def reference(decodes) -> str:
    # A decode instance is a whole engine: without kv_transfer_params it computes locally.
    return _complete(decodes["fd-recompute"])


def _prefill(name: str, certs, token_file, log_dir, *extra: str, port: int | None = None,
             side_port: int | None = None) -> Serve:
    p = Serve(name, log_dir, "--role", "prefill", "--handshake", "http",
              "--side-channel-port", str(side_port or free_port()), *_side(token_file), *extra,
              tls=certs, port=port)
    p.wait_ready(time.monotonic() + 180)
    return p


def _complete(engine: Serve, params: dict | None = None, max_tokens: int = 8) -> str:
    body = {"model": "kvbridge-tiny", "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(engine.url + "/v1/completions", json=body, verify=engine.verify, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"] if params is None or max_tokens > 1 else r.json()


def _held(prefill: Serve) -> dict:
    """A prefill request whose blocks the prefill now holds for a decode."""
    out = _complete(prefill, {"do_remote_decode": True}, max_tokens=1)
    return out["kv_transfer_params"]


def _free(engine: Serve) -> float:
    return engine.metric("kvbridge_blocks_free")


def test_prefill_killed_before_handshake(decodes, reference, certs, token_file,
                                         serve_log_dir):
    p = _prefill("victim-1", certs, token_file, serve_log_dir)
    params = _held(p)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    rec, fail = decodes["fd-recompute"], decodes["fd-fail"]
    free = {d.name: _free(d) for d in (rec, fail)}
    assert _complete(rec, params) == reference                    # recomputed, nothing lost
    t0 = time.monotonic()
    r = httpx.post(fail.url + "/v1/completions", verify=fail.verify, timeout=60, json={
        "model": "kvbridge-tiny", "prompt": PROMPT, "max_tokens": 8,
        "kv_transfer_params": params})
    assert r.status_code == 502, r.text  # the fail policy's documented status
    assert "handshake" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < TIMEOUT + 3
    assert {d.name: _free(d) for d in (rec, fail)} == free
    assert _complete(fail) == reference                           # still serving


def test_prefill_killed_after_handshake(decodes, reference, certs, token_file, serve_log_dir):
    """The decode has the prefill's agent cached; the prefill dies; the next READ fails
    (or times out) and the request recomputes; the stale peer is dropped."""
    rec = decodes["fd-recompute"]
    p = _prefill("victim-2", certs, token_file, serve_log_dir)
    assert _complete(rec, _held(p)) == reference                  # handshake + READ work
    params = _held(p)
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    free = _free(rec)
    failed = rec.metric('kvbridge_kv_loads_total{outcome="failed"}')
    assert _complete(rec, params) == reference
    assert rec.metric('kvbridge_kv_loads_total{outcome="failed"}') == failed + 1
    assert _free(rec) == free
    # the dead peer was dropped: the next request naming it handshakes again (and fails)
    handshakes = rec.metric("kvbridge_handshake_seconds_count")
    assert _complete(rec, params) == reference
    assert rec.metric("kvbridge_handshake_seconds_count") == handshakes + 1


def test_prefill_restarted_on_same_ports(decodes, reference, certs, token_file, serve_log_dir):
    rec = decodes["fd-recompute"]
    api, side = free_port(), free_port()
    p = _prefill("victim-3a", certs, token_file, serve_log_dir, port=api, side_port=side)
    old = _held(p)
    assert _complete(rec, old) == reference
    p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    p2 = _prefill("victim-3b", certs, token_file, serve_log_dir, "--engine-id",
                  old["remote_engine_id"], port=api, side_port=side)
    try:
        new = _held(p2)
        assert new["remote_epoch"] != old["remote_epoch"]
        handshakes = rec.metric("kvbridge_handshake_seconds_count")
        ok = rec.metric('kvbridge_kv_loads_total{outcome="ok"}')
        # new epoch seen: stale agent dropped, handshake again, KV read from the new one
        assert _complete(rec, new) == reference
        assert rec.metric("kvbridge_handshake_seconds_count") == handshakes + 1
        assert rec.metric('kvbridge_kv_loads_total{outcome="ok"}') == ok + 1
        # params of the dead instance name blocks that are gone: recomputed, not read
        assert _complete(rec, old) == reference
        assert rec.metric('kvbridge_kv_loads_total{outcome="ok"}') == ok + 1
        wait_until(lambda: p2.metric("kvbridge_held_requests") == 0, 20, "prefill to free",
                   every=0.05)
    finally:
        p2.stop()


def test_decode_killed_mid_request_prefill_frees_at_lease(certs, token_file, serve_log_dir):
    p = _prefill("victim-4", certs, token_file, serve_log_dir, "--kv-lease-seconds", "2")
    d = Serve("dying-decode", serve_log_dir, "--role", "decode", *_side(token_file), tls=certs)
    try:
        d.wait_ready(time.monotonic() + 180)
        free = _free(p)
        params = _held(p)
        assert _free(p) < free
        threading.Thread(target=lambda: _swallow(d, params), daemon=True).start()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        wait_until(lambda: _free(p) == free, 20, "prefill blocks back after the lease",
                   every=0.05)
        assert p.metric("kvbridge_held_requests") == 0
    finally:
        d.stop()
        p.stop()


def _swallow(d: Serve, params: dict) -> None:
    try:
        _complete(d, params)
    except (httpx.HTTPError, AssertionError):
        pass  # the decode is being killed under this request


def test_side_channel_that_never_answers(decodes):
    """A port that accepts connections and never answers: bounded by the handshake
    timeout, never by an OS default."""
    fail = decodes["fd-fail"]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        params = {"do_remote_prefill": True, "remote_engine_id": "silent",
                  "remote_block_ids": [0, 1], "remote_request_id": "r",
                  "remote_host": "127.0.0.1", "remote_port": silent.getsockname()[1],
                  "tp_size": 1, "handshake_method": "http"}
        t0 = time.monotonic()
        r = httpx.post(fail.url + "/v1/completions", verify=fail.verify, timeout=60, json={
            "model": "kvbridge-tiny", "prompt": PROMPT, "max_tokens": 4,
            "kv_transfer_params": params})
        elapsed = time.monotonic() - t0
    assert r.status_code == 502, r.text  # the fail policy's documented status
    assert "handshake" in r.json()["error"]["message"].lower()
    assert elapsed < TIMEOUT + 3


def test_sigterm_drains_held_blocks(decodes, reference, certs, token_file, serve_log_dir):
    """SIGTERM: the API stops taking requests, the side channel and held blocks stay
    until the decode has read them, then the process exits 0."""
    rec = decodes["fd-recompute"]
    p = _prefill("draining", certs, token_file, serve_log_dir, "--kv-lease-seconds", "60")
    params = _held(p)
    p.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: _api_closed(p), 20, "the prefill API to close", every=0.05)
    assert p.proc.poll() is None                                  # still draining
    ok = rec.metric('kvbridge_kv_loads_total{outcome="ok"}')
    assert _complete(rec, params) == reference                    # read from the drainer
    assert rec.metric('kvbridge_kv_loads_total{outcome="ok"}') == ok + 1
    assert p.proc.wait(timeout=30) == 0


def _api_closed(p: Serve) -> bool:
    try:
        httpx.get(p.url + "/health", verify=p.verify, timeout=1)
        return False
    except httpx.TransportError:
        return True
