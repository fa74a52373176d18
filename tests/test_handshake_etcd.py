"""The ``etcd`` handshake method against a real etcd: same envelope and checks as http/zmq,
metadata under a lease, a watch that brings a restarted prefill's new epoch; and for real,
a decode that keeps loading KV across a prefill restart without a failed READ."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import httpx
import pytest

from kvbridge.config import SideChannelConfig
from kvbridge.errors import CompatibilityError, ConfigError, HandshakeTimeout, RegistryError
from kvbridge.handshake import make_client, make_server
from kvbridge.handshake.etcd import HANDSHAKE_PREFIX, EtcdHandshakeClient, EtcdHandshakeServer
from kvbridge.registry import EtcdRegistry, parse_registry_url
from kvbridge.tools.launch import KVBridgeProcess, free_port, read_metric
from tests.conftest import ROOT
from tests.helpers import compat, full_store, rank_meta, wait_until

HOST = "127.0.0.1"


def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    # an etcd read that times out on a busy machine is "not yet", not a failure
    wait_until(cond, timeout, what, tolerate=(RegistryError,))


def _config(etcd, **kw) -> SideChannelConfig:
    return SideChannelConfig.load(
        {
            "handshake_method": "etcd",
            "registry": etcd.url,
            "side_channel_port": 0,
            "handshake_timeout": 2,
            **kw,
        },
        environ={},
    )


def test_etcd_method_needs_a_registry():
    with pytest.raises(ConfigError, match="registry"):
        SideChannelConfig.load({"handshake_method": "etcd"}, environ={})
    with pytest.raises(ConfigError, match="registry"):
        make_client(SideChannelConfig(), compat(), "etcd")
    with pytest.raises(ConfigError):
        SideChannelConfig.load({"registry": "http://x"}, environ={})


def test_publish_fetch_and_checks(etcd):
    cfg = _config(etcd)
    server = make_server(cfg, full_store(2))
    assert isinstance(server, EtcdHandshakeServer) and server.port > 0
    server.start()
    client = make_client(cfg, compat())
    assert isinstance(client, EtcdHandshakeClient)
    try:
        assert server.published.wait(5)
        assert client.fetch(HOST, server.port, 1) == [rank_meta(1, 2)]
        assert client.fetch(HOST, server.port) == [rank_meta(0, 2), rank_meta(1, 2)]
        # the same compat check as http/zmq, before the body
        with pytest.raises(CompatibilityError):
            make_client(cfg, compat(dtype="float32")).fetch(HOST, server.port, 0)
        # another port: nothing published there; retried until the deadline
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeout, match="nothing published"):
            client.fetch(HOST, server.port + 1, 0)
        assert 1.5 < time.monotonic() - t0 < 10  # bounded (2 s deadline), on a busy machine too
    finally:
        server.stop()
    # stopped: revoked, so the keys are gone at once (not at the TTL)
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    assert reg.get_prefix(HANDSHAKE_PREFIX)[0] == {}
    client.close()


def test_crashed_prefill_expires_and_new_epoch_arrives_by_watch(etcd):
    cfg = _config(etcd)
    port = free_port()
    old = EtcdHandshakeServer(
        full_store(1, epoch="epoch-a"), cfg.registry_endpoint, HOST, port, ttl=1
    )
    old.start()
    client = make_client(cfg, compat())
    try:
        assert old.published.wait(5)
        assert client.fetch(HOST, port, 0)[0].epoch == "epoch-a"
        # a crash: the keep-alive stops, nobody revokes; the lease ends within its TTL
        old.abandon(5)
        # (etcd makes any TTL under 2 s a 2 s one, and checks expiry every 0.5 s)
        _wait(lambda: client.watched() == set(), 2 + 15, "expired, seen by watch")
        # the restarted prefill (same address, new epoch) publishes ...
        new = EtcdHandshakeServer(full_store(1, epoch="epoch-b"), cfg.registry_endpoint, HOST, port)
        new.start()
        try:
            assert new.published.wait(5)
            key = f"{HANDSHAKE_PREFIX}{HOST}:{port}/0"
            _wait(lambda: key in client.watched(), 10, "new epoch delivered by the watch")
            reads = client.reads
            assert client.fetch(HOST, port, 0)[0].epoch == "epoch-b"
            assert client.reads == reads  # answered from the watch: no etcd read
        finally:
            new.stop()
    finally:
        client.close()


# --- for real: kvbridge serve --handshake etcd, a prefill restarted -----------------------

PROMPT = "A restarted prefill publishes a new epoch; the decode follows it through etcd."


def _serve(name: str, log_dir, *args: str) -> tuple[KVBridgeProcess, str]:
    port = free_port()
    proc = KVBridgeProcess(
        name,
        log_dir,
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float64",
        "--handshake-timeout",
        "20",  # a loaded machine must not turn a slow handshake into a failed load
        *args,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        log_level="info",
    )
    return proc, f"http://127.0.0.1:{port}"


def _complete(url: str, **extra) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={
            "model": "kvbridge-tiny",
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_restarted_prefill_switches_without_a_failed_read(etcd, tmp_path):
    side_port = str(free_port())
    prefill_args = (
        "--role",
        "prefill",
        "--handshake",
        "etcd",
        "--registry",
        etcd.url,
        "--engine-id",
        "etcd-prefill",
        "--side-channel-port",
        side_port,
    )
    p, p_url = _serve("p", tmp_path, *prefill_args)
    d, d_url = _serve("d", tmp_path, "--role", "decode", "--registry", etcd.url)
    try:
        deadline = time.monotonic() + 180
        p.wait_healthy(p_url + "/health", deadline)
        d.wait_healthy(d_url + "/health", deadline)
        reference = _complete(d_url)["choices"][0]["text"]

        def through_pd() -> tuple[str, dict]:
            params = _complete(p_url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            kv = params["kv_transfer_params"]
            assert kv["handshake_method"] == "etcd"
            return _complete(d_url, kv_transfer_params=kv)["choices"][0]["text"], kv

        with httpx.Client() as c:

            def metric(name: str) -> float:
                return read_metric(c, d_url, name)

            text, kv = through_pd()
            assert text == reference
            assert metric('kvbridge_kv_loads_total{outcome="ok"}') == 1, d.tail()
            p.stop()  # SIGTERM; then a new process, same engine id and address
            p, p_url2 = _serve("p2", tmp_path, *prefill_args)
            p.wait_healthy(p_url2 + "/health", time.monotonic() + 180)
            p_url = p_url2
            text, kv2 = through_pd()
            assert kv2["remote_epoch"] != kv["remote_epoch"]
            assert text == reference
            assert metric('kvbridge_kv_loads_total{outcome="ok"}') == 2, d.tail()
            assert metric('kvbridge_kv_loads_total{outcome="failed"}') == 0
            assert metric("kvbridge_requests_recomputed_total") == 0
    finally:
        p.stop()
        d.stop()


def test_metadata_withdrawn_while_the_instance_cannot_serve(etcd):
    """What http and zmq answer 503 for is not left in etcd either."""
    cfg = _config(etcd)
    store = full_store(1)
    state: dict[str, str | None] = {"why": None}
    store.health = lambda: state["why"]
    server = make_server(cfg, store)
    server.start()
    reg = EtcdRegistry(parse_registry_url(etcd.url))
    try:
        assert server.published.wait(5)
        assert len(reg.get_prefix(HANDSHAKE_PREFIX)[0]) == 2  # rank 0 and "all"
        state["why"] = "a node of the instance is gone"
        _wait(lambda: reg.get_prefix(HANDSHAKE_PREFIX)[0] == {}, 10, "withdrawn")
        state["why"] = None
        _wait(lambda: len(reg.get_prefix(HANDSHAKE_PREFIX)[0]) == 2, 10, "published again")
    finally:
        server.stop()


def test_a_republish_etcd_refused_is_put_again(etcd):
    """New payloads (a vLLM wake-up) while etcd does not answer: the record is put again,
    under the same lease, as soon as etcd answers; no decode is left with the old one."""
    from kvbridge.handshake.payloads import PayloadStore, fetch_payloads

    endpoint = parse_registry_url(etcd.url)
    store = PayloadStore("test/opaque", "engine-a", "epoch-1", tp_size=1)
    store.set_payloads({(0, 0): b"before"})
    server = EtcdHandshakeServer(store, endpoint, HOST, free_port(), ttl=60)
    server.start()

    def served() -> bytes:
        client = EtcdHandshakeClient(2.0, None, endpoint=endpoint)  # reads etcd itself first
        try:
            return fetch_payloads(client, "test/opaque", HOST, server.port, [(0, 0)]
                                  ).payloads[(0, 0)]
        finally:
            client.close()

    try:
        assert server.published.wait(10)
        assert served() == b"before"
        store.set_payloads({(0, 0): b"after"})
        etcd.pause()
        try:
            server.republish()  # etcd hangs: the put times out, kept for later
        finally:
            etcd.resume()
        wait_until(lambda: served() == b"after", 30, "the republished payload in etcd",
                   tolerate=(RegistryError, HandshakeTimeout))
    finally:
        server.stop()



def test_a_client_closed_at_once_leaves_no_watch_behind(etcd):
    """Closed right after it was made (its watch maybe not open yet), a client's watch
    thread ends within close(): a watch opened after close() is refused rather than left
    blocked on its stream."""
    endpoint = parse_registry_url(etcd.url)
    for _ in range(20):  # the race close() loses at one moment or another of the start
        client = EtcdHandshakeClient(2.0, None, endpoint=endpoint)
        client.close()
        assert not client._thread.is_alive()
    registry = EtcdRegistry(endpoint)
    registry.close()
    with pytest.raises(RegistryError, match="closed"):
        next(registry.watch_prefix(HANDSHAKE_PREFIX, 1))
