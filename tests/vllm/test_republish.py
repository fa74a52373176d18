"""A republish of the NIXL metadata (vLLM 0.33 calls ``set_xfer_handshake_metadata`` again
after a wake-up that re-registered the KV cache) reaches every method's server: the real
vLLM scheduler connector, no vLLM server."""

from __future__ import annotations

import pytest

from kvbridge.handshake.http.client import HttpHandshakeClient
from kvbridge.handshake.payloads import fetch_payloads
from kvbridge.handshake.zmq.vllm_wire import VllmZmqClient

pytest.importorskip("vllm")

from tests.vllm.objects import agent_of, payload, scheduler_connector  # noqa: E402


def publish_twice(connector, fetch) -> None:
    """As vLLM's engine core: at start-up, then again after a wake-up (it calls the
    scheduler's ``set_xfer_handshake_metadata`` through the connector)."""
    sched = connector.connector_scheduler
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): payload(b"agent-before-sleep")})
    port = sched.side_channel_port
    assert port and agent_of(fetch(port)) == b"agent-before-sleep"
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): payload(b"agent-after-wake-up")})
    assert sched.side_channel_port == port  # the same listener, not a second one
    assert agent_of(fetch(port)) == b"agent-after-wake-up"


def test_a_republish_is_served_over_http() -> None:
    from kvbridge.vllm.connector import PAYLOAD_KIND

    client = HttpHandshakeClient(5.0, None)
    try:
        with scheduler_connector({"handshake_method": "http"}) as connector:
            publish_twice(connector, lambda port: fetch_payloads(
                client, PAYLOAD_KIND, "127.0.0.1", port, [(0, 0)]).payloads[(0, 0)])
    finally:
        client.close()


def test_a_republish_is_served_over_vllms_zmq_wire() -> None:
    client = VllmZmqClient(5.0, 1 << 20)
    with scheduler_connector({"handshake_method": "zmq"}) as connector:
        publish_twice(connector,
                      lambda port: client.fetch_ranks("127.0.0.1", port, [(0, 0)]).payloads[(0, 0)])


def test_a_republish_reaches_the_etcd_record(etcd) -> None:
    from kvbridge.handshake.etcd import EtcdHandshakeClient
    from kvbridge.registry import parse_registry_url
    from kvbridge.vllm.connector import PAYLOAD_KIND

    endpoint = parse_registry_url(etcd.url)

    with scheduler_connector({"handshake_method": "etcd", "registry": etcd.url}) as connector:
        engine = connector.connector_scheduler.engine_id

        def fetch(port: int) -> bytes:
            # A new client each time: its first read is etcd's record itself, not a watch
            # that might not have delivered the put yet.
            client = EtcdHandshakeClient(5.0, None, endpoint=endpoint)
            try:
                return fetch_payloads(client, PAYLOAD_KIND, "127.0.0.1", port, [(0, 0)],
                                      expected_engine_id=engine).payloads[(0, 0)]
            finally:
                client.close()

        publish_twice(connector, fetch)
