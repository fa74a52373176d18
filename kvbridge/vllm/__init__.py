"""kvbridge inside vLLM: ``KVBridgeConnector``, vLLM's NixlConnector with kvbridge's side channel.

vLLM loads it by name::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.vllm",
                           "kv_role": "kv_both", "kv_buffer_device": "cpu"}'

Importing this package does not import vLLM: ``KVBridgeConnector`` is loaded (and the vLLM
version checked) on first access, so ``kvbridge.vllm.launch`` and ``kvbridge.vllm.wire``
work without it. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        import vllm

        from kvbridge.vllm.settings import check_vllm_version

        check_vllm_version(vllm.__version__)
        from kvbridge.vllm.connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
