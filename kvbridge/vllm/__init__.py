"""kvbridge inside vLLM: ``KVBridgeConnector``, vLLM's NixlConnector with kvbridge's side channel
(and ``KVBridgePushConnector``, its NixlPushConnector likewise).

vLLM loads it by name::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.vllm",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu"}'

Importing this package does not import vLLM: each connector class is loaded (and the vLLM
version checked) on first access, so what does not need vLLM (its settings, the tools'
launchers) works without it. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBridgeConnector", "KVBridgePushConnector"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import vllm

        from kvbridge.vllm.settings import check_vllm_version

        check_vllm_version(vllm.__version__)
        from kvbridge.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
