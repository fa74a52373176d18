"""The fleet registry: instances register under an etcd lease, proxies watch them.

``parse_registry_url`` reads ``etcd://HOST:PORT`` (``etcds://`` for TLS);
``Registrar`` keeps one instance's record alive; ``EtcdRegistry.watch_prefix`` feeds a live
view (``kvbridge.proxy.membership``).

Modules: ``record`` (an instance's record and its key, strict), ``etcd_client`` (the etcd v3
client through the gRPC gateway: lease, put, range, a watch that reports compaction),
``registrar`` (``Registrar``: one instance's record kept under a lease). A throw-away etcd
for tests is ``kvbridge.tools.testing.etcd_server``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.registry.etcd_client import EtcdEndpoint, EtcdRegistry, parse_registry_url
    from kvbridge.registry.record import INSTANCES_PREFIX, InstanceRecord, instance_key
    from kvbridge.registry.registrar import Registrar

# Each name loads its module on first use: ``record`` alone (the plug-in's registration
# record) must not import ``etcd_client`` and so etcd3gw, the fleet extra.
_MODULES = {
    "EtcdEndpoint": "etcd_client", "EtcdRegistry": "etcd_client",
    "parse_registry_url": "etcd_client",
    "INSTANCES_PREFIX": "record", "InstanceRecord": "record", "instance_key": "record",
    "Registrar": "registrar",
}

__all__ = [
    "INSTANCES_PREFIX",
    "EtcdEndpoint",
    "EtcdRegistry",
    "InstanceRecord",
    "Registrar",
    "instance_key",
    "parse_registry_url",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
