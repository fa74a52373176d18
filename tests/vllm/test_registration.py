"""The plug-in's registration settings (kv_connector_extra_config) and its record in a real
etcd: what ``kvbridge proxy --registry`` reads. The full path with vLLM processes is in
tests/vllm/test_plugin_http.py (the proxy in front of a registered pair)."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.registry.etcd_client import EtcdRegistry, parse_registry_url
from kvbridge.registry.record import INSTANCES_PREFIX, InstanceRecord
from kvbridge.vllm.registration import instance_record, start_registration
from kvbridge.vllm.settings import load_settings
from tests.helpers import wait_until

ETCD = "etcd://127.0.0.1:2379"


def test_api_url_turns_registration_on() -> None:
    s = load_settings({"handshake_method": "http", "registry": ETCD, "role": "prefill",
                       "api_url": "http://10.1.2.3:8000/", "registry_ttl": 5}, environ={})
    assert s.registration is not None
    assert (s.registration.api_url, s.registration.role, s.registration.ttl) == (
        "http://10.1.2.3:8000", "prefill", 5)
    # A registry alone is the etcd method's store: nothing registered.
    assert load_settings({"registry": ETCD}, environ={}).registration is None


@pytest.mark.parametrize("extra, says", [
    ({"role": "prefill"}, "need api_url"),
    ({"api_url": "http://127.0.0.1:8000"}, "needs a registry"),
    ({"api_url": "ftp://h", "registry": ETCD}, "http:// or https://"),
    ({"api_url": "http://h:1", "registry": ETCD, "role": "leader"},
     r"extra_config\['role'\]='leader': use one of prefill, decode, both"),
    ({"api_url": "http://h:1", "registry": ETCD, "registry_ttl": 0},
     r"extra_config\['registry_ttl'\]=0: must be >= 1"),
])
def test_bad_registration_settings_are_one_line(extra, says) -> None:
    with pytest.raises(ConfigError, match=says) as e:
        load_settings(extra, environ={})
    assert "\n" not in str(e.value) and str(e.value).startswith("kvbridge.vllm:")


def test_the_record_is_in_etcd_until_deregistered(etcd) -> None:
    s = load_settings({"handshake_method": "http", "registry": etcd.url, "role": "decode",
                       "api_url": "http://127.0.0.1:8200"}, environ={})
    assert s.registration is not None
    record = instance_record(s.registration, s.side_channel, engine_id="vllm-engine-1",
                             epoch="e1", tp_size=1, compat_hash="abc123", model="model",
                             side_channel_port=5601)
    registry = EtcdRegistry(parse_registry_url(etcd.url))
    registrar = start_registration(s.registration, s.side_channel, record)
    try:
        kvs = wait_until(lambda: registry.get_prefix(INSTANCES_PREFIX)[0], 30, "registered")
        (key, value), = kvs.items()
        assert key == f"{INSTANCES_PREFIX}decode/vllm-engine-1"
        got = InstanceRecord.decode(value)
        assert (got.api_url, got.compat_hash, got.side_channel_port, got.handshake_method) == (
            "http://127.0.0.1:8200", "abc123", 5601, "http")
    finally:
        assert registrar.deregister()
    assert registry.get_prefix(INSTANCES_PREFIX)[0] == {}
