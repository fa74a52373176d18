"""``kvbridge serve --registry``: what an instance tells the registry about itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.metadata import compat_hash
from kvbridge.net import url_host
from kvbridge.registry.etcd_client import EtcdEndpoint, EtcdRegistry
from kvbridge.registry.record import InstanceRecord
from kvbridge.registry.registrar import Registrar
from kvbridge.settings import is_wildcard

if TYPE_CHECKING:
    from kvbridge.server.instance import Instance

def api_url(scheme: str, host: str, port: int, advertised: str) -> str:
    """The URL peers reach the API at: the bind host, or the advertised one for a wildcard."""
    host = advertised if is_wildcard(host) else host
    return f"{scheme}://{url_host(host)}:{port}"


def record_of(inst: Instance, url: str) -> InstanceRecord:
    sc = inst.opts.side_channel
    serves_kv = inst.side_channel_port is not None
    engine = inst.engine.engine
    return InstanceRecord(
        engine_id=inst.engine_id,
        epoch=inst.epoch,
        role=inst.opts.role,
        api_url=url,
        tp_size=inst.opts.tp_size,
        compat_hash=compat_hash(inst.compat),
        model=inst.model_name,
        side_channel_host=sc.advertised if serves_kv else None,
        side_channel_port=inst.side_channel_port,
        handshake_method=sc.handshake_method if serves_kv else None,
        load=engine.num_blocks - engine.num_free_blocks,
    )


def start_registration(inst: Instance, endpoint: EtcdEndpoint, url: str, ttl: int) -> Registrar:
    """Register ``inst`` and keep it registered (in a thread) until ``deregister``."""
    # Withdrawn while the engine cannot serve (e.g. a node of the instance is gone).
    return Registrar(
        EtcdRegistry(endpoint), lambda: record_of(inst, url), ttl, health=inst.health_problem
    ).start()
