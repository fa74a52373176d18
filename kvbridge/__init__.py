"""kvbridge: KV-cache transfer metadata side channel and NIXL data plane.

The small public API for engine authors who embed the side channel and the data plane in
an engine of their own (docs/library.md walks through it):

* the cache:       ``kv_cache_shape``, ``allocate_kv_cache``
* the data plane:  ``NixlAgent`` (register the cache, READ head slices, notifications,
  ``close``)
* serving metadata: ``MetadataStore``, ``make_server``, ``compat_of``
* handshaking:     ``make_client``, ``PeerManager`` (background, cached per engine id and
  epoch; each local rank fetches only the remote ranks it reads, see ``plan_reads``)
* contracts:       ``SideChannelConfig``, ``TLSConfig``, ``KVTransferParams``, and every
  exception (``kvbridge.errors``)

Names are imported on first use, so ``import kvbridge`` stays cheap (no torch, no NIXL).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "kv_cache_shape": "kvbridge.kv_cache",
    "allocate_kv_cache": "kvbridge.kv_cache",
    "NixlAgent": "kvbridge.transfer",
    "MetadataStore": "kvbridge.handshake",
    "make_server": "kvbridge.handshake",
    "make_client": "kvbridge.handshake",
    "compat_of": "kvbridge.metadata",
    "RankMetadata": "kvbridge.metadata",
    "PeerManager": "kvbridge.peers",
    "plan_reads": "kvbridge.tp_mapping",
    "SideChannelConfig": "kvbridge.config",
    "TLSConfig": "kvbridge.config",
    "KVTransferParams": "kvbridge.params",
    "KVBridgeError": "kvbridge.errors",
}

__all__ = [
    "KVBridgeError", "KVTransferParams", "MetadataStore", "NixlAgent", "PeerManager",
    "RankMetadata", "SideChannelConfig", "TLSConfig", "__version__", "allocate_kv_cache",
    "compat_of", "kv_cache_shape", "make_client", "make_server", "plan_reads",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from kvbridge.config import SideChannelConfig, TLSConfig
    from kvbridge.errors import KVBridgeError
    from kvbridge.handshake import MetadataStore, make_client, make_server
    from kvbridge.kv_cache import allocate_kv_cache, kv_cache_shape
    from kvbridge.metadata import RankMetadata, compat_of
    from kvbridge.params import KVTransferParams
    from kvbridge.peers import PeerManager
    from kvbridge.tp_mapping import plan_reads
    from kvbridge.transfer import NixlAgent


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:  # an optional part: name the extra that installs it
        from kvbridge.extras import missing_extra_message

        line = missing_extra_message(e, f"kvbridge.{name}")
        if line is None:
            raise
        raise ModuleNotFoundError(line, name=e.name) from e
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
