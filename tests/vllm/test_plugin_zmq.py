"""The plug-in's zmq method speaks vLLM 0.32's own zmq handshake: plug-in and stock
NixlConnector instances read from each other (a rolling migration). Three vLLM servers."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvbridge.tools.testing.procfs import group_cpu_seconds
from kvbridge.tools.vllm.launch import VllmServer, decode, prefill
from tests.helpers import wait_until
from tests.vllm.conftest import (
    MAX_TOKENS,
    NO_PREFIX_CACHE,
    PROMPT,
    REQUEST_TIMEOUT,
    answer,
    kv_reads,
    nixl_bytes,
    num_tokens,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def servers(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """Three instances, each both prefill and decode (kv_both): two plug-ins and a stock
    NixlConnector. No prefix cache: every P/D of the same prompt reads the KV again."""
    d = tmp_path_factory.mktemp("vllm-zmq")
    # vLLM's own listener answers from its engine core's thread, which a busy engine can
    # starve for seconds on 2 shared cores: the plug-in's decodes give it 30 s, not 10.
    zmq_cfg = {"handshake_method": "zmq", "handshake_timeout": 30}
    plug_a = VllmServer.start(model, name="plugin-a", core=0, log_dir=d, extra_config=zmq_cfg,
                              extra_args=NO_PREFIX_CACHE)
    stock = VllmServer.start(model, name="stock", connector="nixl", core=1, log_dir=d,
                             extra_args=NO_PREFIX_CACHE)
    plug_b = VllmServer.start(model, name="plugin-b", core=1, log_dir=d, extra_config=zmq_cfg,
                              extra_args=NO_PREFIX_CACHE)
    with running(plug_a, stock, plug_b):
        yield {"plugin-a": plug_a, "stock": stock, "plugin-b": plug_b}


@pytest.fixture(scope="module")
def expected(servers) -> str:
    """The text computed without any KV transfer (an instance asked directly)."""
    return answer(servers["stock"])


def _pd(p: VllmServer, d: VllmServer, attempts: int = 1):
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    assert params["remote_port"] == p.side_channel_port
    before = nixl_bytes(d)
    for attempt in range(attempts):
        r = decode(d.url, PROMPT, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
        if r.status_code == 200 or attempt == attempts - 1:
            break
        params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    return r, nixl_bytes(d) - before


def test_an_idle_plugin_spins_no_core_where_stock_vllm_spins_one(servers):
    """vLLM's worker builds its NIXL agent with a busy-polling progress thread; the plug-in
    builds it with kvbridge's nixl_progress_delay_us (docs/vllm.md §5c). Both servers are
    idle here, before any P/D request of the module (a held request keeps vLLM's engine
    stepping until its lease ends): CPU seconds per second, each server's whole process
    group, over the same window."""
    stock, plugin = servers["stock"], servers["plugin-a"]
    before = {s.name: group_cpu_seconds(s.proc.pid) for s in (stock, plugin)}
    start = time.monotonic()
    time.sleep(3.0)  # the measuring window itself, not a wait for an event
    took = time.monotonic() - start
    used = {s.name: (group_cpu_seconds(s.proc.pid) - before[s.name]) / took
            for s in (stock, plugin)}
    print(f"idle CPU-seconds per second: {used}")  # the figure docs/vllm.md §5c cites
    assert used["plugin-a"] < 0.25, used  # was a whole core, as stock's
    assert used["stock"] > 2 * used["plugin-a"], used


@pytest.mark.parametrize("pair", [("plugin-a", "plugin-b"), ("stock", "plugin-a"),
                                  ("plugin-a", "stock")],
                         ids=["plugin-to-plugin", "stock-to-plugin", "plugin-to-stock"])
def test_pd_over_vllms_own_zmq_wire(servers, expected, pair):
    p, d = servers[pair[0]], servers[pair[1]]
    # A stock decode waits a fixed 5 s for the handshake reply, and a stock prefill's listener
    # answers when its engine core lets it: on a starved machine either can miss (vLLM then
    # fails the request, as it does without the plug-in): one more request then.
    validated = kv_reads(d, "validated") if pair[1] != "stock" else 0.0
    r, read = _pd(p, d, attempts=2 if "stock" in pair else 1)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    assert read > 0  # read over NIXL, not recomputed
    if pair == ("plugin-a", "plugin-b"):  # block tags on both sides: the READ is validated
        wait_until(lambda: kv_reads(d, "validated") > validated, 30, "a validated READ")
    elif pair == ("stock", "plugin-a"):  # a stock prefill has none: read as before, said once
        assert "has no block tags (a stock vLLM?)" in d.log_text()


def test_plugin_listener_survives_what_kills_vllms_own(servers, expected):
    """A malformed request, an unknown rank and an oversized message: the plug-in's
    listener answers or drops that peer and keeps serving."""
    p = servers["plugin-a"]
    ctx = zmq.Context.instance()
    addr = f"tcp://127.0.0.1:{p.side_channel_port}"

    def ask(frames: list[bytes], wait_ms: int) -> list[bytes] | None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(addr)
            sock.send_multipart(frames)
            return sock.recv_multipart() if sock.poll(wait_ms) else None
        finally:
            sock.close(linger=0)

    assert ask([b"", b"\xc1not msgpack"], 1000) is None  # not vLLM's wire: no answer
    assert ask([b"", b"x" * (64 * 1024)], 1000) is None  # over 16 KiB: dropped
    # An unknown rank (vLLM's own listener dies on the KeyError): an empty payload, at once.
    reply = ask([b"", msgspec.msgpack.encode((b"get_meta_msg", 0, 7))], 60_000)
    assert reply is not None and reply[:2] == [b"", b""]
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    r = decode(servers["plugin-b"].url, PROMPT, params, max_tokens=MAX_TOKENS,
               timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected


def test_a_stale_read_with_vllms_fail_policy_is_an_error_not_a_wrong_answer(servers):
    """vLLM's default kv_load_failure_policy ("fail"): a READ whose block tags differ from
    the decode's prompt (here: the params of a prompt of the same length, another word)
    ends the request with an error, and the decode's log names the request and why (vLLM's
    error carries no reason)."""
    p, d = servers["plugin-a"], servers["plugin-b"]
    other = PROMPT.replace("France", "Italy")
    assert other != PROMPT and num_tokens(d, other) == num_tokens(d, PROMPT)
    params = prefill(p.url, PROMPT, REQUEST_TIMEOUT)
    stale = kv_reads(d, "stale")
    r = decode(d.url, other, params, max_tokens=MAX_TOKENS, timeout=REQUEST_TIMEOUT)
    failed = r.status_code != 200 or r.json()["choices"][0].get("finish_reason") == "error"
    assert failed, r.text
    wait_until(lambda: kv_reads(d, "stale") == stale + 1, 30, "the stale READ is counted")
    assert "is stale: recomputed or refused per kv_load_failure_policy" in d.log_text()

