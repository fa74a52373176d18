"""A plug-in instance in the fleet registry: the same record as ``kvbridge serve --registry``,
so ``kvbridge proxy --registry`` discovers vLLM instances and pairs them by compatibility
hash. No vLLM import here.

vLLM's engine core, where the plug-in's scheduler side runs, does not know the address of
its own API server, so the record's ``api_url`` comes from ``kv_connector_extra_config``
(``api_url``: setting it turns registration on), as do the instance's ``role`` (default
``both``) and the lease's ``registry_ttl`` (default 10 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.config import SideChannelConfig
from kvbridge.errors import ConfigError
from kvbridge.registry.record import InstanceRecord
from kvbridge.settings import SETTINGS, Setting

# kv_connector_extra_config keys of the registration (beside the side channel's settings):
# the tree's other extra-config keys (not the side channel's, not the plug-in's own).
REGISTRATION_KEYS = frozenset(s.name for s in SETTINGS if s.extra_config
                              and s.group not in ("side_channel", "vllm"))
DEFAULT_TTL: int = SETTINGS["registry_ttl"].default


def extra_label(s: Setting) -> str:
    """How an error names a ``kv_connector_extra_config`` key."""
    return f"kv_connector_extra_config[{s.name!r}]"


@dataclass(frozen=True)
class RegistrationSettings:
    api_url: str
    role: str = SETTINGS["role"].default
    ttl: int = DEFAULT_TTL


def registration_settings(extra: Mapping[str, Any], side: SideChannelConfig
                          ) -> RegistrationSettings | None:
    """What to register (``api_url`` given), or None; ``ConfigError`` in one line.

    A ``registry`` alone does not register: the ``etcd`` handshake method uses it too.
    """
    url = extra.get("api_url")
    if url is None:
        stray = sorted(k for k in REGISTRATION_KEYS if k in extra)
        if stray:
            raise ConfigError(f"kvbridge.vllm: {stray} register this instance and need "
                              "api_url (the URL of this vLLM server's API as clients reach it)")
        return None
    if side.registry is None:
        raise ConfigError("kvbridge.vllm: api_url registers this instance and needs a "
                          "registry (etcd://HOST:PORT)")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"kvbridge.vllm: api_url {url!r}: an http:// or https:// URL of this "
                          "vLLM server's API as clients reach it")
    try:
        values = SETTINGS.resolve(["role", "registry_ttl"], extra, {}, extra_label)
    except ConfigError as e:
        raise ConfigError(f"kvbridge.vllm: {e}") from None
    return RegistrationSettings(url.rstrip("/"), values["role"], values["registry_ttl"])


def instance_record(reg: RegistrationSettings, side: SideChannelConfig, *, engine_id: str,
                    epoch: str, tp_size: int, compat_hash: str, model: str,
                    side_channel_port: int) -> InstanceRecord:
    return InstanceRecord(
        engine_id=engine_id, epoch=epoch, role=reg.role, api_url=reg.api_url, tp_size=tp_size,
        compat_hash=compat_hash, model=model, side_channel_host=side.advertised,
        side_channel_port=side_channel_port, handshake_method=side.handshake_method)


def start_registration(reg: RegistrationSettings, side: SideChannelConfig,
                       record: InstanceRecord):  # -> Registrar (the fleet extra)
    """Register ``record`` under a lease and keep it alive (a thread) until ``deregister``."""
    from kvbridge.registry.etcd_client import EtcdRegistry
    from kvbridge.registry.registrar import Registrar

    return Registrar(EtcdRegistry(side.registry_endpoint), lambda: record, reg.ttl).start()
