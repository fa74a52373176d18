"""The fleet registry: instances register under an etcd lease, proxies watch them.

``parse_registry_url`` reads ``etcd://HOST:PORT`` (``etcds://`` for TLS);
``Registrar`` keeps one instance's record alive; ``EtcdRegistry.watch_prefix`` feeds a live
view (``kvbridge.server.membership``).

Modules: ``record`` (an instance's record and its key, strict), ``etcd`` (the etcd v3
client through the gRPC gateway: lease, put, range, a watch that reports compaction),
``registrar`` (``Registrar``: one instance's record kept under a lease). A throw-away etcd
for tests is ``kvbridge.testing.etcd``.
"""

from __future__ import annotations

from kvbridge.registry.etcd import EtcdEndpoint, EtcdRegistry, parse_registry_url
from kvbridge.registry.record import INSTANCES_PREFIX, InstanceRecord, instance_key
from kvbridge.registry.registrar import Registrar

__all__ = [
    "INSTANCES_PREFIX",
    "EtcdEndpoint",
    "EtcdRegistry",
    "InstanceRecord",
    "Registrar",
    "instance_key",
    "parse_registry_url",
]
