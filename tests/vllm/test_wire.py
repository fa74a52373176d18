"""The plug-in's pieces on real sockets (no vLLM server): vLLM 0.32's zmq wire against vLLM's
own listener code, opaque payloads over the http side channel, settings and version."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvbridge.errors import AuthError, ConfigError, HandshakeTimeout, PeerMismatch, WireFormatError
from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.http.server import HttpHandshakeServer
from kvbridge.handshake.payloads import PayloadStore, fetch_payloads
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient, VllmZmqServer
from kvbridge.metadata import (
    PayloadEnvelope,
    decode_envelope,
    decode_payload_envelope,
    encode_payload_envelope,
)
from kvbridge.net import free_port
from kvbridge.vllm.settings import check_vllm_version, load_settings
from tests.helpers import full_store

KIND = "test/opaque"


def test_client_reads_vllms_own_listener():
    """vLLM's listener (its code, in a thread) answers the plug-in's client."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )

    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    data = {(0, 0): b"rank-0-payload", (0, 1): b"rank-1-payload"}
    t = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                         args=(data, ready, stop, "127.0.0.1", port), daemon=True)
    t.start()
    try:
        assert ready.wait(10)
        got = VllmZmqClient(5.0, 1 << 20).fetch_ranks("127.0.0.1", port, [(0, 1), (0, 0)])
        assert got.payloads == {(0, 1): b"rank-1-payload", (0, 0): b"rank-0-payload"}
        # Same process, same perf_counter: the estimated offset is about zero.
        assert abs(got.clock_offset) < 0.5
    finally:
        stop.set()
        t.join(5)


def test_server_answers_a_client_exactly_as_vllms():
    """What vLLM's ``_nixl_handshake`` does on the wire: REQ, one request, two frames back."""
    server = VllmZmqServer({(0, 0): b"payload-0"}, "127.0.0.1", 0)
    server.start()
    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        sock.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
        parts = sock.recv_multipart()
        assert len(parts) == 2 and parts[0] == b"payload-0"
        assert abs(msgspec.msgpack.decode(parts[1]) - time.perf_counter()) < 5
    finally:
        sock.close(linger=0)
        server.stop()


def test_bounded_zmq_client_and_server():
    server = VllmZmqServer({(0, 0): b"p0"}, "127.0.0.1", 0)
    server.start()
    try:
        client = VllmZmqClient(2.0, 1 << 20)
        assert client.fetch_ranks("127.0.0.1", server.port, [(0, 0)]).payloads == {(0, 0): b"p0"}
        start = time.monotonic()
        with pytest.raises(PeerMismatch, match="tp rank 3"):  # at once, not after a timeout
            client.fetch_ranks("127.0.0.1", server.port, [(0, 3)])
        assert time.monotonic() - start < 1.5
        # A peer sending junk is not answered, and the listener keeps serving.
        junk = zmq.Context.instance().socket(zmq.DEALER)
        junk.setsockopt(zmq.LINGER, 0)
        junk.connect(f"tcp://127.0.0.1:{server.port}")
        junk.send_multipart([b"", b"\xc1"])
        assert not junk.poll(300)
        junk.close(linger=0)
        assert client.fetch_ranks("127.0.0.1", server.port, [(0, 0)]).payloads == {(0, 0): b"p0"}
    finally:
        server.stop()
    start = time.monotonic()
    with pytest.raises(HandshakeTimeout):  # nobody there: the deadline, not vLLM's fixed 5 s
        VllmZmqClient(0.5, 1 << 20).fetch_ranks("127.0.0.1", free_port(), [(0, 0)])
    assert time.monotonic() - start < 2


@pytest.fixture
def payload_server():
    store = PayloadStore(KIND, "engine-a", "epoch-1", tp_size=2, pp_size=1)
    server = HttpHandshakeServer(store, "127.0.0.1", 0, token="s3cret")
    server.start()
    yield store, server
    server.stop()


def test_payloads_over_http_with_token(payload_server):
    store, server = payload_server
    client = HttpHandshakeClient(3.0, None, token="s3cret")
    base = f"http://127.0.0.1:{server.port}"
    assert httpx.get(f"{base}/readyz").status_code == 503  # no rank in yet
    with pytest.raises(Exception, match="503"):
        fetch_payloads(HttpHandshakeClient(0.3, None, token="s3cret"), KIND, "127.0.0.1",
                       server.port, [(0, 0)])
    store.set_payloads({(0, 0): b"zero", (0, 1): b"one"})
    assert httpx.get(f"{base}/readyz").status_code == 200
    got = fetch_payloads(client, KIND, "127.0.0.1", server.port, [(0, 1)])
    assert (got.engine_id, got.epoch, got.payloads) == ("engine-a", "epoch-1", {(0, 1): b"one"})
    assert abs(got.clock_offset) < 0.5
    both = fetch_payloads(client, KIND, "127.0.0.1", server.port, [(0, 0), (0, 1)])
    assert both.payloads == {(0, 0): b"zero", (0, 1): b"one"}
    with pytest.raises(AuthError):
        fetch_payloads(HttpHandshakeClient(3.0, None, token="wrong"), KIND, "127.0.0.1",
                       server.port, [(0, 0)])
    with pytest.raises(WireFormatError, match="we read 'other'"):
        fetch_payloads(client, "other", "127.0.0.1", server.port, [(0, 0)])
    view = httpx.get(f"{base}/v1/kv/handshake", headers={
        "accept": "application/json", "authorization": "Bearer s3cret"}).json()
    assert view["epoch"] == "epoch-1" and [r["payload_bytes"] for r in view["ranks"]] == [4, 3]
    client.close()


def test_the_two_envelopes_are_never_mistaken_for_each_other():
    env = encode_payload_envelope(PayloadEnvelope(
        payload_schema=1, kind=KIND, engine_id="e", epoch="x", clock=1.0, wall=2.0, ranks=[]))
    with pytest.raises(WireFormatError):
        decode_envelope(env, None)
    rank_env = full_store(2).reply(None).body
    with pytest.raises(WireFormatError):
        decode_payload_envelope(rank_env, KIND)
    with pytest.raises(WireFormatError, match="exceeds"):
        decode_payload_envelope(env, KIND, max_bytes=len(env) - 1)


def test_settings_from_extra_config_then_env_then_vllm_alias(tmp_path: Path):
    env = {"KVBRIDGE_HANDSHAKE_TIMEOUT": "3", "VLLM_NIXL_HANDSHAKE_TIMEOUT": "7",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": "6000", "VLLM_NIXL_SIDE_CHANNEL_HOST": "localhost"}
    s = load_settings({"handshake_method": "http", "enforce_handshake_compat": True,
                       "ucx_backend_params": {}, "transfer_mode": "pull"}, 0, env)
    sc = s.side_channel
    assert (sc.handshake_method, sc.handshake_timeout, sc.side_channel_port,
            sc.side_channel_host) == ("http", 3.0, 6000, "localhost")
    assert load_settings({"side_channel_port": 5700}, 2, env).side_channel.side_channel_port \
        == 5702  # + the data-parallel index, as vLLM
    assert load_settings({"side_channel_port": 0}, 2, env).side_channel.side_channel_port == 0
    token = tmp_path / "token"
    token.write_text("t")
    os.chmod(token, 0o600)
    assert load_settings({"handshake_method": "http", "token_file": str(token)}, 0,
                         {}).side_channel.token == "t"


@pytest.mark.parametrize("extra, match", [
    ({"handshake_methd": "http"}, "unknown kv_connector_extra_config key"),
    ({"handshake_method": "carrier-pigeon"},
     r"kv_connector_extra_config\['handshake_method'\]='carrier-pigeon'"),
    ({"token": "t"}, "token needs handshake_method 'http'"),
    ({"ssl_certfile": "/x.pem"}, "TLS settings need handshake_method 'http'"),
    ({"handshake_method": "http", "ssl_cert_reqs": "required"}, "client certificates"),
    ({"handshake_method": "http", "token_file": "/nonexistent"}, "cannot read token file"),
    ({"transfer_mode": "push"}, "transfer_mode 'push' is not served by KVBridgeConnector"),
])
def test_bad_settings_are_one_line(extra, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_settings(extra, 0, {})
    assert "\n" not in str(e.value) and str(e.value).startswith("kvbridge.vllm: ")


def test_each_connector_takes_its_own_transfer_mode_only():
    """vLLM's factory reads transfer_mode only for the name NixlConnector: under the plug-in's
    names a mode other than the class's would be ignored, so it is refused, naming the class
    that serves it."""
    assert load_settings({"transfer_mode": "push"}, 0, {}, mode="push").method == "zmq"
    assert load_settings({}, 0, {}, mode="push").method == "zmq"
    with pytest.raises(ConfigError, match="transfer_mode 'push' is not served by "
                       "KVBridgeConnector, which is pull only: use KVBridgePushConnector"):
        load_settings({"transfer_mode": "push"}, 0, {})
    with pytest.raises(ConfigError, match="transfer_mode 'pull' is not served by "
                       "KVBridgePushConnector, which is push only: use KVBridgeConnector"):
        load_settings({"transfer_mode": "pull"}, 0, {}, mode="push")


def test_vllm_version_outside_the_tested_range_is_refused():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3+cpu")
    check_vllm_version("0.33.0")
    check_vllm_version("0.33.1+cu130")
    check_vllm_version("0.34.0")
    for v in ("0.31.9", "0.35.0", "1.0.0"):
        with pytest.raises(ConfigError, match=r"outside the tested range vllm>=0\.32\.0,<0\.35") as e:
            check_vllm_version(v)
        assert "\n" not in str(e.value)


def test_payloads_over_etcd_and_a_restarted_publisher(etcd):
    """The etcd method: payloads published under a lease; a publisher restarted under the
    same name with a new engine id is waited for (a stale record is not taken)."""
    from kvbridge.handshake.etcd import EtcdHandshakeClient, EtcdHandshakeServer
    from kvbridge.registry import parse_registry_url

    endpoint = parse_registry_url(etcd.url)
    port = free_port()

    def publish(engine: str, epoch: str) -> EtcdHandshakeServer:
        store = PayloadStore(KIND, engine, epoch, tp_size=1)
        store.set_payloads({(0, 0): engine.encode()})
        server = EtcdHandshakeServer(store, endpoint, "127.0.0.1", port)
        server.start()
        assert server.published.wait(10)
        return server

    client = EtcdHandshakeClient(5.0, None, endpoint=endpoint)
    first = publish("engine-a", "epoch-1")
    try:
        got = fetch_payloads(client, KIND, "127.0.0.1", port, [(0, 0)],
                             expected_engine_id="engine-a")
        assert (got.epoch, got.payloads) == ("epoch-1", {(0, 0): b"engine-a"})
        assert abs(got.clock_offset) < 1.0
    finally:
        first.stop()
    second = publish("engine-b", "epoch-2")
    try:
        got = fetch_payloads(client, KIND, "127.0.0.1", port, [(0, 0)],
                             expected_engine_id="engine-b")
        assert (got.engine_id, got.epoch) == ("engine-b", "epoch-2")
    finally:
        second.stop()
        client.close()
