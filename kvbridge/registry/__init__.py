"""The fleet registry: instances register under an etcd lease, proxies watch them.

``parse_registry_url`` reads ``etcd://HOST:PORT`` (``etcds://`` for TLS);
``Registrar`` keeps one instance's record alive; ``watch_instances`` feeds a live view.
"""

from __future__ import annotations

from kvbridge.registry.etcd import (
    EtcdEndpoint,
    EtcdRegistry,
    Registrar,
    parse_registry_url,
)
from kvbridge.registry.record import INSTANCES_PREFIX, InstanceRecord, instance_key

__all__ = [
    "INSTANCES_PREFIX",
    "EtcdEndpoint",
    "EtcdRegistry",
    "InstanceRecord",
    "Registrar",
    "instance_key",
    "parse_registry_url",
]
